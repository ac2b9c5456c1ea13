//! Line plots of sweeps, as SVG and PNG, with plotters and no system libraries. Both backends
//! lay text out with a TrueType font: the first of a few common paths (DejaVu, Liberation; Debian
//! package fonts-dejavu-core) is loaded at run time. Without one, no plot is drawn and the
//! caller keeps its tables.

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
    /// A thin line in the same colour above the points, when the line is a mean and this its
    /// maximum (commands in flight per bucket of time); empty for none.
    pub upper: Vec<(f64, f64)>,
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
                // Every family plotters may ask for, so no label goes without a face.
                let all = ["sans-serif", "serif", "monospace"].iter().all(|family| {
                    plotters::style::register_font(family, FontStyle::Normal, bytes).is_ok()
                });
                if all {
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
    if !font_ready() {
        return Err(format!(
            "no TrueType font for the labels (looked for {})",
            FONTS.join(", ")
        ));
    }
    let svg = stem.with_extension("svg");
    let png = stem.with_extension("png");
    let drawn = (|| {
        let area = SVGBackend::new(&svg, (900, 560)).into_drawing_area();
        draw(area, title, x_label, y_label, series)
            .map_err(|e| format!("{}: {e}", svg.display()))?;
        let area = BitMapBackend::new(&png, (900, 560)).into_drawing_area();
        draw(area, title, x_label, y_label, series).map_err(|e| format!("{}: {e}", png.display()))
    })();
    if let Err(e) = drawn {
        // No plot: no empty or half-drawn file left behind to be taken for one.
        let _ = std::fs::remove_file(&svg);
        let _ = std::fs::remove_file(&png);
        return Err(e);
    }
    Ok(vec![svg, png])
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
) -> Result<(), String> {
    let err = |step: &str, e: &dyn std::fmt::Display| format!("plot {step}: {e}");
    // No finite point, no axes to scale: plotters would search an empty or endless range for
    // tick marks forever.
    let finite = |p: &&(f64, f64)| p.0.is_finite() && p.1.is_finite();
    if !series.iter().any(|s| s.points.iter().any(|p| finite(&p))) {
        return Err("nothing to plot (no data points)".into());
    }
    root.fill(&WHITE).map_err(|e| err("fill", &e))?;
    let xs = series
        .iter()
        .flat_map(|s| s.points.iter().filter(finite).map(|p| p.0));
    let ys = series
        .iter()
        .flat_map(|s| s.points.iter().chain(&s.upper).filter(finite).map(|p| p.1));
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
            .map_err(|e| err("build", &e))?;
        c.configure_mesh()
            .x_desc(x_label)
            .y_desc(y_label)
            .draw()
            .map_err(|e| err("mesh", &e))?;
        lines(&mut c, series)?;
        legend(&mut c)
    } else {
        let mut c = chart
            .build_cartesian_2d(x0..x1, 0.0..y1)
            .map_err(|e| err("build", &e))?;
        c.configure_mesh()
            .x_desc(x_label)
            .y_desc(y_label)
            .draw()
            .map_err(|e| err("mesh", &e))?;
        lines(&mut c, series)?;
        legend(&mut c)
    }?;
    root.present().map_err(|e| err("present", &e))
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
        if !s.upper.is_empty() {
            c.draw_series(LineSeries::new(
                s.upper.iter().copied(),
                color.mix(0.6).stroke_width(1),
            ))
            .map_err(|e| format!("plot: {e}"))?;
        }
        // A sweep's few points are marked; a series over time is a line only.
        if s.points.len() <= 64 {
            c.draw_series(s.points.iter().map(|&p| Circle::new(p, 3, color.filled())))
                .map_err(|e| format!("plot: {e}"))?;
        }
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
        .map_err(|e| format!("plot legend: {e}"))
}

/// One track of a timeline: its label and its slices (start, end), in milliseconds.
#[derive(Debug, Clone)]
pub struct Track {
    /// Label, shown on the left.
    pub label: String,
    /// Slices (start, end), ms.
    pub slices: Vec<(f64, f64)>,
}

/// Writes `path` (PNG): one band per track, its slices as bars stacked into as many rows as
/// overlap at once (so concurrency shows as height), time across, as the paper's figures
/// draw a trace.
pub fn timeline(path: &Path, title: &str, tracks: &[Track]) -> Result<(), String> {
    if !font_ready() {
        return Err(format!(
            "no TrueType font for the labels (looked for {})",
            FONTS.join(", ")
        ));
    }
    // Each slice's row within its track: the first row free at its start.
    let mut rows: Vec<Vec<(f64, f64, usize)>> = Vec::new();
    let mut heights = Vec::new();
    for t in tracks {
        let mut sorted = t.slices.clone();
        sorted.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut ends: Vec<f64> = Vec::new();
        let mut placed = Vec::with_capacity(sorted.len());
        for (a, b) in sorted {
            let row = match ends.iter().position(|&e| e <= a) {
                Some(r) => r,
                None => {
                    ends.push(0.0);
                    ends.len() - 1
                }
            };
            ends[row] = b;
            placed.push((a, b, row));
        }
        heights.push(ends.len().max(1));
        rows.push(placed);
    }
    let total: usize = heights.iter().sum::<usize>().max(1);
    let x0 = tracks
        .iter()
        .flat_map(|t| t.slices.iter().map(|s| s.0))
        .fold(f64::MAX, f64::min);
    let x1 = tracks
        .iter()
        .flat_map(|t| t.slices.iter().map(|s| s.1))
        .fold(f64::MIN, f64::max);
    let (x0, x1) = if x0 < x1 { (x0, x1) } else { (0.0, 1.0) };
    let err = |step: &str, e: &dyn std::fmt::Display| format!("timeline {step}: {e}");
    let root = BitMapBackend::new(path, (1200, 120 + 60 * tracks.len() as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err("fill", &e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(250)
        .build_cartesian_2d(x0..x1, 0.0..total as f64)
        .map_err(|e| err("build", &e))?;
    // A track's band is labelled at its middle.
    let mut bands = Vec::new();
    let mut base = 0usize;
    for (t, h) in tracks.iter().zip(&heights) {
        // At a whole row, where the axis has a tick.
        bands.push(((base + h / 2) as f64, t.label.clone()));
        base += h;
    }
    let labels = bands.clone();
    chart
        .configure_mesh()
        .x_desc("ms")
        .disable_y_mesh()
        .y_labels(total + 1)
        .y_label_formatter(&move |y| {
            labels
                .iter()
                .find(|(mid, _)| (mid - y).abs() < 0.01)
                .map(|(_, l)| l.clone())
                .unwrap_or_default()
        })
        .draw()
        .map_err(|e| err("mesh", &e))?;
    let mut base = 0usize;
    for (i, (placed, h)) in rows.iter().zip(&heights).enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let top = base as f64;
        chart
            .draw_series(placed.iter().map(|&(a, b, row)| {
                let y = top + row as f64;
                Rectangle::new(
                    [(a, y + 0.1), (b.max(a + (x1 - x0) / 2000.0), y + 0.9)],
                    color.filled(),
                )
            }))
            .map_err(|e| err("slices", &e))?;
        base += h;
    }
    root.present().map_err(|e| err("present", &e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_svg_and_png_when_a_font_is_present() {
        let dir = std::env::temp_dir().join(format!("plot-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let series = [Series {
            label: "IOPS".into(),
            points: vec![(1.0, 10.0), (2.0, 20.0), (128.0, 900.0)],
            upper: Vec::new(),
        }];
        match plot(&dir.join("p"), "title", "x", "y", &series) {
            Ok(files) => {
                for f in files {
                    assert!(
                        std::fs::metadata(&f).unwrap().len() > 1000,
                        "{} is empty",
                        f.display()
                    );
                }
            }
            Err(e) if !font_ready() && std::env::var_os("CI").is_none() => {
                eprintln!("skipping the plot test: {e} (Debian package fonts-dejavu-core)")
            }
            Err(e) => panic!("{e}"),
        }
        let _ = std::fs::remove_dir_all(dir);
    }
}
