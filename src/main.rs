use clap::CommandFactory;

fn main() {
    tftf::sys::return_freed_buffers_to_the_os();
    tftf::sys::default_sigpipe();
    // `run`'s pipe sections are split off first: clap cannot express them.
    let (args, sections) = tftf::commands::run_sections::split(std::env::args_os().collect());
    let matches = tftf::cli::Cli::command().get_matches_from(args);
    let cancel = tftf::pipeline::Cancel::default();
    let on_signal = cancel.clone();
    // The first Ctrl-C cancels the run, which then removes its temporary files; a second one
    // exits at once.
    let _ = ctrlc::set_handler(move || {
        if on_signal.is_raised() {
            std::process::exit(tftf::error::EXIT_INTERRUPTED);
        }
        eprintln!("interrupt: stopping and removing temporary output…");
        on_signal.raise();
    });
    match tftf::commands::dispatch(&matches, &sections, &cancel) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {}", tftf::escape::name(&e.to_string()));
            std::process::exit(e.exit_code());
        }
    }
}
