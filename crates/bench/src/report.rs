//! `keel bench report`: JSON results → a markdown table and an SVG latency CDF.
//!
//! The SVG is written by hand: one polyline per result, latency on a log-10 x axis (decades
//! from the fastest to the slowest op seen), cumulative share of ops on a linear y axis.

use std::fmt::Write as _;

use crate::profile::{format_bytes, format_latency, BenchResult};

/// Width and height of the SVG in pixels.
const SVG_WIDTH: f64 = 900.0;
const SVG_HEIGHT: f64 = 520.0;
/// Margins around the plot area (left, right, top, bottom) in pixels.
const MARGIN_LEFT: f64 = 70.0;
const MARGIN_RIGHT: f64 = 50.0;
const MARGIN_TOP: f64 = 40.0;
const MARGIN_BOTTOM: f64 = 60.0;
/// Line colours, reused in turn.
const COLOURS: &[&str] = &[
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf",
];
/// Height of one legend row in pixels.
const LEGEND_ROW_PIXELS: f64 = 16.0;

fn escape_markdown(text: &str) -> String {
    text.replace('|', "\\|")
}

fn escape_xml(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A markdown table: one row per result and operation kind.
pub fn markdown_table(results: &[BenchResult]) -> String {
    let mut text = String::from(
        "| label | profile | op | block | QD | durability | IOPS | MiB/s | min | p50 | p99 | p99.9 | max | ops | >10× p50 | warnings |\n\
         | --- | --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n",
    );
    for result in results {
        let mut rows = Vec::new();
        let (read_name, write_name) = if result.operation == "put" || result.operation == "get" {
            ("get", "put")
        } else {
            ("read", "write")
        };
        if let Some(reads) = &result.reads {
            rows.push((read_name, reads));
        }
        if let Some(writes) = &result.writes {
            rows.push((write_name, writes));
        }
        if rows.is_empty() {
            rows.push(("all", &result.all));
        }
        let mut warnings = Vec::new();
        if result.memory_backed {
            warnings.push("**tmpfs/RAM: not a disk**");
        }
        if result.volatile_write_cache == Some(true) {
            warnings.push("volatile write cache");
        }
        if result.direct_io == Some(false) {
            warnings.push("page cache");
        }
        for (operation, stats) in rows {
            let latency = &stats.latency;
            let _ = writeln!(
                text,
                "| {} | {} | {} | {} | {} | {} | {:.0} | {:.2} | {} | {} | {} | {} | {} | {} | {:.2}% | {} |",
                escape_markdown(&result.label),
                result.profile,
                operation,
                format_bytes(result.block_size_bytes),
                result.queue_depth,
                escape_markdown(&result.durability),
                stats.iops,
                stats.mib_per_second,
                format_latency(latency.min_us),
                format_latency(latency.p50_us),
                format_latency(latency.p99_us),
                format_latency(latency.p999_us),
                format_latency(latency.max_us),
                stats.ops,
                stats.slow_share * 100.0,
                warnings.join(", ")
            );
        }
    }
    text
}

/// An SVG latency CDF: one polyline per result (all operations), log-x.
pub fn svg_cdf(results: &[BenchResult]) -> String {
    let curves: Vec<(String, Vec<(f64, f64)>)> = results
        .iter()
        .filter(|result| !result.all.cdf.is_empty())
        .map(|result| {
            let name = format!("{} {} ({})", result.label, result.profile, result.operation);
            let points = result
                .all
                .cdf
                .iter()
                .map(|point| (point.latency_us.max(0.001), point.percentile))
                .collect();
            (name, points)
        })
        .collect();
    let lowest = curves
        .iter()
        .flat_map(|(_, points)| points.iter().map(|point| point.0))
        .fold(f64::INFINITY, f64::min);
    let highest = curves
        .iter()
        .flat_map(|(_, points)| points.iter().map(|point| point.0))
        .fold(0.0, f64::max);
    let (decade_low, decade_high) = if curves.is_empty() {
        (0.0, 1.0)
    } else {
        let low = lowest.log10().floor();
        let high = highest.log10().ceil().max(low + 1.0);
        (low, high)
    };
    let legend_height = curves.len() as f64 * LEGEND_ROW_PIXELS;
    let height = SVG_HEIGHT + legend_height;
    let plot_width = SVG_WIDTH - MARGIN_LEFT - MARGIN_RIGHT;
    let plot_height = SVG_HEIGHT - MARGIN_TOP - MARGIN_BOTTOM;
    let x_of = |latency_us: f64| {
        MARGIN_LEFT + (latency_us.log10() - decade_low) / (decade_high - decade_low) * plot_width
    };
    let y_of = |percentile: f64| MARGIN_TOP + plot_height * (1.0 - percentile / 100.0);

    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{SVG_WIDTH}" height="{height}" viewBox="0 0 {SVG_WIDTH} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="15">Latency CDF (share of operations at or below a latency)</text>"#,
        SVG_WIDTH / 2.0
    );
    // Grid and axis labels: one vertical line per decade, horizontal every 10 %.
    let mut decade = decade_low;
    while decade <= decade_high + 1e-9 {
        let x = x_of(10f64.powf(decade));
        let _ = writeln!(
            svg,
            r##"<line x1="{x:.1}" y1="{MARGIN_TOP}" x2="{x:.1}" y2="{:.1}" stroke="#ddd"/>"##,
            MARGIN_TOP + plot_height
        );
        let _ = writeln!(
            svg,
            r#"<text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            MARGIN_TOP + plot_height + 18.0,
            escape_xml(&format_latency(10f64.powf(decade)))
        );
        decade += 1.0;
    }
    for step in 0..=10 {
        let percentile = step as f64 * 10.0;
        let y = y_of(percentile);
        let _ = writeln!(
            svg,
            r##"<line x1="{MARGIN_LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#ddd"/>"##,
            MARGIN_LEFT + plot_width
        );
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{percentile:.0}%</text>"#,
            MARGIN_LEFT - 6.0,
            y + 4.0
        );
    }
    let _ = writeln!(
        svg,
        r##"<rect x="{MARGIN_LEFT}" y="{MARGIN_TOP}" width="{plot_width}" height="{plot_height}" fill="none" stroke="#333"/>"##
    );
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">latency (log scale)</text>"#,
        MARGIN_LEFT + plot_width / 2.0,
        MARGIN_TOP + plot_height + 40.0
    );
    for (index, (name, points)) in curves.iter().enumerate() {
        let colour = COLOURS[index % COLOURS.len()];
        let mut path = String::new();
        for &(latency, percentile) in points {
            let _ = write!(path, "{:.1},{:.1} ", x_of(latency), y_of(percentile));
        }
        let _ = writeln!(
            svg,
            r#"<polyline fill="none" stroke="{colour}" stroke-width="2" points="{}"/>"#,
            path.trim_end()
        );
        let y = SVG_HEIGHT - 4.0 + index as f64 * LEGEND_ROW_PIXELS;
        let _ = writeln!(
            svg,
            r#"<line x1="{MARGIN_LEFT}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{colour}" stroke-width="3"/>"#,
            y - 4.0,
            MARGIN_LEFT + 24.0,
            y - 4.0
        );
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{y:.1}">{}</text>"#,
            MARGIN_LEFT + 30.0,
            escape_xml(name)
        );
    }
    svg.push_str("</svg>\n");
    svg
}
