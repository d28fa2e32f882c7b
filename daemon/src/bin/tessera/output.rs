//! Standard output for a command whose reader may go away (`tessera top | head`,
//! `tessera events --follow | head -2`): a closed pipe ends the command quietly with status 0,
//! not with a panic. `print!` and `println!` in the CLI write through [`write`].

use std::fmt::Arguments;
use std::io::{ErrorKind, IsTerminal, Write};

/// Writes to stdout and flushes (so a follower sees each line at once); a reader that is gone
/// ends the process quietly, any other error ends it with a message.
pub fn write(args: Arguments<'_>) {
    let mut out = std::io::stdout().lock();
    match out.write_fmt(args).and_then(|()| out.flush()) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::BrokenPipe => std::process::exit(0),
        Err(e) => {
            eprintln!("tessera: writing to stdout: {e}");
            std::process::exit(1);
        }
    }
}

/// Whether stdout is a terminal (screen control only then).
pub fn is_terminal() -> bool {
    std::io::stdout().is_terminal()
}
