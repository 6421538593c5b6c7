use clap::CommandFactory;

fn main() {
    tftf::sys::return_freed_buffers_to_the_os();
    let cancel = tftf::pipeline::Cancel::default();
    let on_signal = cancel.clone();
    // Before any thread starts: every thread inherits the blocked signals.
    if let Err(e) = tftf::signals::install(move || on_signal.raise()) {
        // The run can go on: a signal then ends it at once, as it does most programs.
        tftf::errln!("warning: cannot take over SIGINT and SIGTERM ({e}); a signal will end the run without removing its temporary files");
    }
    // `run`'s pipe sections are split off first: clap cannot express them.
    let (args, sections) = tftf::commands::run_sections::split(std::env::args_os().collect());
    let matches = tftf::cli::Cli::command().get_matches_from(args);
    let result = tftf::commands::dispatch(&matches, &sections, &cancel);
    match &result {
        Err(e) => tftf::errln!("error: {}", tftf::escape::name(&e.to_string())),
        // Stdout lost (a full disk, a closed pipe): stderr may still tell.
        Ok(_) => tftf::console::notes()
            .iter()
            .for_each(|n| tftf::errln!("note: {n}")),
    }
    // A signal ends the run with its code, whatever the run made of the cancel.
    if let Some(signal) = tftf::signals::received() {
        std::process::exit(tftf::signals::exit_code(signal));
    }
    std::process::exit(match result {
        Ok(code) => code,
        Err(e) => e.exit_code(),
    });
}
