fn main() -> std::process::ExitCode {
    kvfleet::cli::main()
}
