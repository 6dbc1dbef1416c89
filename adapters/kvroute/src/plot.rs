//! `--plot`: one SVG with, top to bottom, the TTFT CDF of each policy, load imbalance
//! over time (busiest worker ÷ mean, smoothed), and one worker × time heatmap of active
//! KV blocks per policy, all on one colour scale so the heatmaps compare.

use std::path::Path;

use plotters::prelude::*;

use crate::report::{LoadPoint, RunReport};

const COLORS: [RGBColor; 6] = [BLUE, RED, GREEN, MAGENTA, CYAN, BLACK];
/// Time columns of the heatmaps and points of the imbalance curves.
const BINS: usize = 240;
/// The imbalance curve averages this many bins either side of each point.
const SMOOTH_BINS: usize = 6;

type Area<'a, DB> = DrawingArea<DB, plotters::coord::Shift>;
type PlotResult = Result<(), Box<dyn std::error::Error>>;

/// Draws the runs to `path`.
pub fn draw(path: &Path, runs: &[RunReport]) -> PlotResult {
    let heat_px = 60 + 22 * runs.iter().map(|r| r.workers).max().unwrap_or(1);
    let root = SVGBackend::new(path, (1000, 400 + 300 + heat_px * runs.len() as u32)).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, rest) = root.split_vertically(400);
    draw_cdf(&top, runs)?;
    let (middle, bottom) = rest.split_vertically(300);
    let t_max = runs.iter().flat_map(|r| &r.loads).map(|p| p.t_s).fold(1.0, f64::max);
    let grids: Vec<Vec<Vec<f64>>> = runs.iter().map(|r| load_grid(&r.loads, r.workers, t_max, BINS)).collect();
    draw_imbalance(&middle, runs, &grids, t_max)?;
    // A few bursts would wash out the rest: the darkest shade starts at the 99th percentile.
    let mut cells: Vec<f64> = grids.iter().flatten().flatten().copied().collect();
    cells.sort_by(f64::total_cmp);
    let top_load = kvroute_sim::stats::nearest_rank(&cells, 99.0).max(1.0);
    let panels = bottom.split_evenly((runs.len().max(1), 1));
    for ((panel, run), grid) in panels.iter().zip(runs).zip(&grids) {
        draw_heatmap(panel, run, grid, t_max, top_load)?;
    }
    root.present()?;
    Ok(())
}

/// Mean active blocks of each worker in each of `bins` equal slices of `0..t_max`
/// (`[worker][bin]`); a slice without a sample holds the worker's previous value.
pub fn load_grid(loads: &[LoadPoint], workers: u32, t_max: f64, bins: usize) -> Vec<Vec<f64>> {
    let (w_n, bins) = (workers as usize, bins.max(1));
    let mut sum = vec![vec![0.0; bins]; w_n];
    let mut count = vec![vec![0u32; bins]; w_n];
    for p in loads.iter().filter(|p| (p.worker as usize) < w_n) {
        let b = ((p.t_s / t_max.max(1e-9)) * bins as f64).clamp(0.0, (bins - 1) as f64) as usize;
        sum[p.worker as usize][b] += f64::from(p.active_blocks);
        count[p.worker as usize][b] += 1;
    }
    for (row, n) in sum.iter_mut().zip(&count) {
        let mut last = 0.0;
        for (v, &k) in row.iter_mut().zip(n) {
            if k > 0 {
                last = *v / f64::from(k);
            }
            *v = last;
        }
    }
    sum
}

/// Busiest worker ÷ mean over workers, per bin; `None` while the fleet is idle.
pub fn imbalance(grid: &[Vec<f64>]) -> Vec<Option<f64>> {
    let bins = grid.first().map_or(0, Vec::len);
    (0..bins)
        .map(|b| {
            let col = grid.iter().map(|row| row[b]);
            let mean = col.clone().sum::<f64>() / grid.len() as f64;
            (mean > 0.0).then(|| col.fold(0.0, f64::max) / mean)
        })
        .collect()
}

/// Centred moving average over `half` points either side, skipping gaps.
pub fn smooth(v: &[Option<f64>], half: usize) -> Vec<Option<f64>> {
    (0..v.len())
        .map(|i| {
            let window = &v[i.saturating_sub(half)..(i + half + 1).min(v.len())];
            let (s, n) = window.iter().flatten().fold((0.0, 0), |(s, n), x| (s + x, n + 1));
            v[i].and((n > 0).then(|| s / f64::from(n)))
        })
        .collect()
}

fn draw_cdf<DB: DrawingBackend>(area: &Area<DB>, runs: &[RunReport]) -> PlotResult
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

fn draw_imbalance<DB: DrawingBackend>(
    area: &Area<DB>,
    runs: &[RunReport],
    grids: &[Vec<Vec<f64>>],
    t_max: f64,
) -> PlotResult
where
    DB::ErrorType: 'static,
{
    let curves: Vec<Vec<Option<f64>>> = grids.iter().map(|g| smooth(&imbalance(g), SMOOTH_BINS)).collect();
    let y_max = curves.iter().flatten().flatten().copied().fold(2.0, f64::max) * 1.05;
    let window_s = t_max / BINS as f64 * (2 * SMOOTH_BINS + 1) as f64;
    let mut chart = ChartBuilder::on(area)
        .caption(
            format!(
                "load imbalance: busiest worker / mean active KV blocks ({window_s:.0} s moving average; 1 = even)"
            ),
            ("sans-serif", 16),
        )
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(45)
        .build_cartesian_2d(0.0..t_max, 1.0..y_max)?;
    chart
        .configure_mesh()
        .x_desc("simulated time, s")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_desc("busiest / mean")
        .draw()?;
    let dt = t_max / BINS as f64;
    for (i, (r, c)) in runs.iter().zip(&curves).enumerate() {
        let color = COLORS[i % COLORS.len()];
        let points = c.iter().enumerate().filter_map(|(b, v)| v.map(|v| ((b as f64 + 0.5) * dt, v)));
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))?
            .label(r.policy.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

fn draw_heatmap<DB: DrawingBackend>(
    area: &Area<DB>,
    run: &RunReport,
    grid: &[Vec<f64>],
    t_max: f64,
    top: f64,
) -> PlotResult
where
    DB::ErrorType: 'static,
{
    let workers = grid.len().max(1);
    let mut chart = ChartBuilder::on(area)
        .caption(
            format!("{}: active KV blocks per worker (white 0, darkest {top:.0}+, the 99th percentile)", run.policy),
            ("sans-serif", 16),
        )
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(45)
        .build_cartesian_2d(0.0..t_max, -0.5..workers as f64 - 0.5)?;
    chart
        .configure_mesh()
        .disable_mesh()
        .x_desc("simulated time, s")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_desc("worker")
        .y_labels(workers)
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()?;
    let dt = t_max / grid.first().map_or(1, Vec::len) as f64;
    let cells = grid.iter().enumerate().flat_map(|(w, row)| {
        row.iter().enumerate().map(move |(b, &v)| {
            let (x0, y0) = (b as f64 * dt, w as f64 - 0.5);
            Rectangle::new([(x0, y0), (x0 + dt, y0 + 1.0)], shade(v / top).filled())
        })
    });
    chart.draw_series(cells)?;
    Ok(())
}

/// White at 0 to dark blue at 1.
fn shade(x: f64) -> RGBColor {
    let x = x.clamp(0.0, 1.0);
    let mix = |hi: f64, lo: f64| (hi + (lo - hi) * x).round() as u8;
    RGBColor(mix(255.0, 8.0), mix(255.0, 48.0), mix(255.0, 107.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(t_s: f64, worker: u32, active_blocks: u32) -> LoadPoint {
        LoadPoint { t_s, worker, active_blocks }
    }

    #[track_caller]
    fn check<T: PartialEq + std::fmt::Debug>(got: T, want: T) {
        assert_eq!(got, want);
    }

    #[test]
    fn grid_averages_each_slice_and_carries_the_last_value() {
        let loads = [p(0.0, 0, 10), p(0.5, 0, 20), p(2.5, 0, 4), p(1.0, 1, 6), p(9.0, 7, 100)];
        // Four slices of one second; worker 7 is outside a two-worker fleet and ignored.
        check(load_grid(&loads, 2, 4.0, 4), vec![vec![15.0, 15.0, 4.0, 4.0], vec![0.0, 6.0, 6.0, 6.0]]);
    }

    #[test]
    fn imbalance_is_busiest_over_mean_and_undefined_when_idle() {
        let grid = vec![vec![0.0, 30.0, 10.0], vec![0.0, 10.0, 10.0]];
        check(imbalance(&grid), vec![None, Some(1.5), Some(1.0)]);
    }

    #[test]
    fn smoothing_averages_neighbours_and_keeps_gaps() {
        let v = [None, Some(1.0), Some(3.0), Some(2.0)];
        check(smooth(&v, 1), vec![None, Some(2.0), Some(2.0), Some(2.5)]);
        check(smooth(&v, 0), v.to_vec());
    }
}
