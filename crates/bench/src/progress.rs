//! A live progress bar on stderr, shown only when stderr is a terminal.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};

/// A bar counting `len` requests; hidden when stderr is not a terminal, so logs and
/// CI output stay clean.
pub fn requests_bar(len: u64) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    let style = ProgressStyle::with_template(
        "{elapsed_precise} [{wide_bar}] {pos}/{len} requests{msg} (eta {eta})",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style);
    bar
}

/// Counts one finished request, noting failures in the bar's message.
pub fn record(bar: &ProgressBar, failed_so_far: u64) {
    bar.inc(1);
    if failed_so_far > 0 {
        bar.set_message(format!(", {failed_so_far} failed"));
    }
}
