fn main() {
    std::process::exit(tftf::entry::run(std::env::args_os().collect()));
}
