//! The status pages' shared script: the gateway's and the worker's `/dashboard` are
//! each one self-contained HTML file whose script starts with the same poll loop,
//! formatting and SVG charts, written once here and put in place when first served.

use std::sync::OnceLock;

use axum::response::{IntoResponse, Response};
use http::header;

/// The script both pages share (see its header comment for what a page must provide).
pub const COMMON_JS: &str = include_str!("dashboard_common.js");

/// Where a page's `<script>` wants [`COMMON_JS`].
pub const COMMON_JS_MARKER: &str = "/* pdserve:dashboard-common.js */";

/// A status page: its HTML template, with [`COMMON_JS`] put in at its marker once.
#[derive(Debug)]
pub struct DashboardPage {
    template: &'static str,
    assembled: OnceLock<String>,
}

impl DashboardPage {
    /// A page from a template holding [`COMMON_JS_MARKER`] once.
    pub const fn new(template: &'static str) -> Self {
        Self {
            template,
            assembled: OnceLock::new(),
        }
    }

    /// The page as served.
    pub fn html(&self) -> &str {
        self.assembled.get_or_init(|| {
            debug_assert_eq!(self.template.matches(COMMON_JS_MARKER).count(), 1);
            self.template.replacen(COMMON_JS_MARKER, COMMON_JS, 1)
        })
    }

    /// `GET /dashboard`: the page, revalidated on every load.
    pub fn response(&'static self) -> Response {
        (
            [
                (header::CONTENT_TYPE, "text/html; charset=utf-8"),
                (header::CACHE_CONTROL, "no-cache"),
            ],
            self.html(),
        )
            .into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_common_script_goes_in_at_the_marker() {
        static PAGE: DashboardPage =
            DashboardPage::new("<script>\n/* pdserve:dashboard-common.js */\npoll();\n</script>");
        let html = PAGE.html();
        assert!(!html.contains(COMMON_JS_MARKER));
        assert!(html.starts_with("<script>\n// Shared by"));
        assert!(html.contains("function drawChart(") && html.contains("async function poll()"));
        assert!(html.ends_with("}\n\npoll();\n</script>"));
    }
}
