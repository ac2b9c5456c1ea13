//! Line plots of sweeps, as SVG and PNG, with plotters and no system libraries. The PNG needs a
//! TrueType font for its labels: the first of a few common paths (DejaVu, Liberation) is loaded at
//! run time; without one only the SVG is written.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;

/// One line of a plot.
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend label.
    pub label: String,
    /// Points (x, y).
    pub points: Vec<(f64, f64)>,
}

const FONTS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
];

/// Registers a system font for the bitmap backend once; false if none was found.
fn font_ready() -> bool {
    static READY: OnceLock<bool> = OnceLock::new();
    *READY.get_or_init(|| {
        for path in FONTS {
            if let Ok(bytes) = std::fs::read(path) {
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return true;
                }
            }
        }
        false
    })
}

/// Writes `stem.svg` and `stem.png`; returns the files written.
pub fn plot(
    stem: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
) -> Result<Vec<PathBuf>, String> {
    let mut written = Vec::new();
    let svg = stem.with_extension("svg");
    draw(
        SVGBackend::new(&svg, (900, 560)).into_drawing_area(),
        title,
        x_label,
        y_label,
        series,
    )?;
    written.push(svg);
    if font_ready() {
        let png = stem.with_extension("png");
        draw(
            BitMapBackend::new(&png, (900, 560)).into_drawing_area(),
            title,
            x_label,
            y_label,
            series,
        )?;
        written.push(png);
    } else {
        tracing::warn!(
            "no TrueType font found ({}); PNG not written",
            FONTS.join(", ")
        );
    }
    Ok(written)
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| format!("plot: {e}");
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let xs = series.iter().flat_map(|s| s.points.iter().map(|p| p.0));
    let ys = series.iter().flat_map(|s| s.points.iter().map(|p| p.1));
    let (x0, x1) = xs.fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(x), b.max(x)));
    let y1 = ys.fold(0.0f64, f64::max).max(1e-9) * 1.1;
    let (x0, x1) = if x0 >= x1 {
        (x0 - 1.0, x1 + 1.0)
    } else {
        (x0, x1)
    };
    let mut chart = ChartBuilder::on(&root);
    chart
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(80);
    // Powers-of-two sweeps (queue depth, sessions, block size) read best on a log axis.
    if x0 > 0.0 && x1 / x0 >= 16.0 {
        let mut c = chart
            .build_cartesian_2d((x0..x1).log_scale(), 0.0..y1)
            .map_err(|e| err(&e))?;
        c.configure_mesh()
            .x_desc(x_label)
            .y_desc(y_label)
            .draw()
            .map_err(|e| err(&e))?;
        lines(&mut c, series)?;
        legend(&mut c)
    } else {
        let mut c = chart
            .build_cartesian_2d(x0..x1, 0.0..y1)
            .map_err(|e| err(&e))?;
        c.configure_mesh()
            .x_desc(x_label)
            .y_desc(y_label)
            .draw()
            .map_err(|e| err(&e))?;
        lines(&mut c, series)?;
        legend(&mut c)
    }?;
    root.present().map_err(|e| err(&e))
}

fn lines<'a, DB, X>(
    c: &mut ChartContext<'a, DB, Cartesian2d<X, plotters::coord::types::RangedCoordf64>>,
    series: &[Series],
) -> Result<(), String>
where
    DB: DrawingBackend + 'a,
    X: Ranged<ValueType = f64>,
{
    for (i, s) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        c.draw_series(LineSeries::new(
            s.points.iter().copied(),
            color.stroke_width(2),
        ))
        .map_err(|e| format!("plot: {e}"))?
        .label(s.label.clone())
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        c.draw_series(s.points.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(|e| format!("plot: {e}"))?;
    }
    Ok(())
}

fn legend<'a, DB, X>(
    c: &mut ChartContext<'a, DB, Cartesian2d<X, plotters::coord::types::RangedCoordf64>>,
) -> Result<(), String>
where
    DB: DrawingBackend + 'a,
    X: Ranged<ValueType = f64>,
{
    c.configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(|e| format!("plot: {e}"))
}
