//! Draws the SVG plots of BENCHMARKS.md from the JSON that `scripts/bench` writes:
//!
//! ```json
//! {"plots": [{"file": "host-latency.svg", "title": "...", "y": "usec (one-way)",
//!             "series": [{"name": "tcp (fabric perf)", "points": [[8, 35.1], [64, 36.0]]}]}]}
//! ```
//!
//! Message size (bytes, log scale) on x; the figure on y (log scale).
//! `fabric-plot RESULTS.json OUT_DIR`

use plotters::prelude::*;
use serde_json::Value;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [input, out_dir] = args.as_slice() else {
        eprintln!("usage: fabric-plot RESULTS.json OUT_DIR");
        std::process::exit(2)
    };
    let text = std::fs::read_to_string(input).unwrap_or_else(|e| {
        eprintln!("fabric-plot: {input}: {e}");
        std::process::exit(1)
    });
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| {
        eprintln!("fabric-plot: {input}: {e}");
        std::process::exit(1)
    });
    std::fs::create_dir_all(out_dir).expect("output directory");
    for plot in v["plots"].as_array().cloned().unwrap_or_default() {
        let file = format!("{out_dir}/{}", plot["file"].as_str().expect("file"));
        if let Err(e) = draw(&plot, &file) {
            eprintln!("fabric-plot: {file}: {e}");
            std::process::exit(1)
        }
        println!("wrote {file}");
    }
}

type Series = (String, Vec<(f64, f64)>);

fn draw(plot: &Value, file: &str) -> Result<(), Box<dyn std::error::Error>> {
    let series: Vec<Series> = plot["series"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|s| {
                    let pts = s["points"]
                        .as_array()
                        .map(|p| {
                            p.iter()
                                .filter_map(|xy| Some((xy[0].as_f64()?, xy[1].as_f64()?)))
                                .filter(|&(x, y)| x > 0.0 && y > 0.0)
                                .collect()
                        })
                        .unwrap_or_default();
                    (s["name"].as_str().unwrap_or("?").to_string(), pts)
                })
                .filter(|(_, p): &Series| !p.is_empty())
                .collect()
        })
        .unwrap_or_default();
    let all = series.iter().flat_map(|(_, p)| p.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in all {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if series.is_empty() {
        (x0, x1, y0, y1) = (1.0, 10.0, 1.0, 10.0);
    }
    let root = SVGBackend::new(file, (800, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(plot["title"].as_str().unwrap_or(""), ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(
            (x0 / 1.5..x1 * 1.5).log_scale(),
            (y0 / 1.5..y1 * 1.5).log_scale(),
        )?;
    chart
        .configure_mesh()
        .x_desc("message size (bytes)")
        .y_desc(plot["y"].as_str().unwrap_or(""))
        .x_label_formatter(&|x| size_label(*x))
        .draw()?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))?
            .label(name.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

fn size_label(x: f64) -> String {
    let x = x.round() as u64;
    match x {
        _ if x >= 1 << 20 && x.is_multiple_of(1 << 20) => format!("{}M", x >> 20),
        _ if x >= 1 << 10 && x.is_multiple_of(1 << 10) => format!("{}K", x >> 10),
        _ => x.to_string(),
    }
}
