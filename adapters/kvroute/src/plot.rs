//! `--plot`: TTFT CDFs per policy and per-worker KV load over time, as one SVG.

use std::path::Path;

use plotters::prelude::*;

use crate::report::RunReport;

const COLORS: [RGBColor; 6] = [BLUE, RED, GREEN, MAGENTA, CYAN, BLACK];

/// Draws the runs to `path`.
pub fn draw(path: &Path, runs: &[RunReport]) -> Result<(), Box<dyn std::error::Error>> {
    let root = SVGBackend::new(path, (1000, 400 + 260 * runs.len() as u32)).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, bottom) = root.split_vertically(400);
    draw_cdf(&top, runs)?;
    let panels = bottom.split_evenly((runs.len().max(1), 1));
    for (panel, run) in panels.iter().zip(runs) {
        draw_load(panel, run)?;
    }
    root.present()?;
    Ok(())
}

fn draw_cdf<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    runs: &[RunReport],
) -> Result<(), Box<dyn std::error::Error>>
where
    DB::ErrorType: 'static,
{
    let x_max = runs.iter().map(|r| r.ttft_ms.p99).fold(1.0, f64::max) * 1.2;
    let mut chart = ChartBuilder::on(area)
        .caption("TTFT CDF (up to 1.2x the worst p99)", ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(45)
        .build_cartesian_2d(0.0..x_max, 0.0..1.0)?;
    chart.configure_mesh().x_desc("TTFT, ms").y_desc("fraction of requests").draw()?;
    for (i, r) in runs.iter().enumerate() {
        let mut v = r.ttft_samples_ms.clone();
        v.sort_by(f64::total_cmp);
        let n = v.len().max(1) as f64;
        let color = COLORS[i % COLORS.len()];
        let points = v.iter().enumerate().map(|(k, &x)| (x.min(x_max), (k + 1) as f64 / n));
        chart
            .draw_series(LineSeries::new(points, color))?
            .label(r.policy.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
    Ok(())
}

fn draw_load<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    run: &RunReport,
) -> Result<(), Box<dyn std::error::Error>>
where
    DB::ErrorType: 'static,
{
    let t_max = run.loads.iter().map(|p| p.t_s).fold(1.0, f64::max);
    let y_max = run.loads.iter().map(|p| p.active_blocks).max().unwrap_or(1).max(1) as f64;
    let mut chart = ChartBuilder::on(area)
        .caption(format!("{}: active KV blocks per worker", run.policy), ("sans-serif", 16))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(55)
        .build_cartesian_2d(0.0..t_max, 0.0..y_max * 1.05)?;
    chart.configure_mesh().x_desc("simulated time, s").draw()?;
    for w in 0..run.workers {
        let color = Palette99::pick(w as usize);
        let pts = run.loads.iter().filter(|p| p.worker == w).map(|p| (p.t_s, f64::from(p.active_blocks)));
        chart.draw_series(LineSeries::new(pts, &color))?;
    }
    Ok(())
}
