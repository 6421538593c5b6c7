"""``python -m tftf``: the ``tftf`` command."""

from tftf.cli import main

if __name__ == "__main__":
    main()
