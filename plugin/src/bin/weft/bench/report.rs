//! Medians, the table, and the plot.

use super::*;

pub(super) fn stats(v: &[f64]) -> (f64, f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let med = if s.is_empty() {
        f64::NAN
    } else if s.len() % 2 == 1 {
        s[s.len() / 2]
    } else {
        (s[s.len() / 2 - 1] + s[s.len() / 2]) / 2.0
    };
    (
        med,
        *s.first().unwrap_or(&f64::NAN),
        *s.last().unwrap_or(&f64::NAN),
    )
}

pub(super) fn human(size: usize) -> String {
    match size {
        s if s >= 1 << 20 => format!("{} MiB", s >> 20),
        s if s >= 1 << 10 => format!("{} KiB", s >> 10),
        s => format!("{s} B"),
    }
}

/// An axis label in decimal units (the log axis ticks at powers of ten).
pub(super) fn decimal(x: f64) -> String {
    match x {
        x if x >= 1e9 => format!("{:.0} GB", x / 1e9),
        x if x >= 1e6 => format!("{:.0} MB", x / 1e6),
        x if x >= 1e3 => format!("{:.0} kB", x / 1e3),
        x => format!("{x:.0} B"),
    }
}

/// A row key: (provider, test, size, window).
pub(super) type Key = (String, String, usize, usize);

pub(super) fn collect(records: &[serde_json::Value]) -> BTreeMap<Key, BTreeMap<String, Vec<f64>>> {
    let mut m: BTreeMap<Key, BTreeMap<String, Vec<f64>>> = BTreeMap::new();
    for r in records {
        let (Some(p), Some(t), Some(s), Some(w), Some(i), Some(v)) = (
            r["provider"].as_str(),
            r["test"].as_str(),
            r["size"].as_u64(),
            r["window"].as_u64(),
            r["impl"].as_str(),
            r["values"].as_array(),
        ) else {
            continue;
        };
        m.entry((p.into(), t.into(), s as usize, w as usize))
            .or_default()
            .insert(i.into(), v.iter().filter_map(|x| x.as_f64()).collect());
    }
    m
}

/// The table on stdout and the rows of the CSV.
pub(super) fn table(m: &BTreeMap<Key, BTreeMap<String, Vec<f64>>>) -> (String, String) {
    let mut t = String::new();
    let mut csv =
        String::from("provider,test,size,window,impl,unit,median,min,max,n,weft_over_raw\n");
    let mut last = String::new();
    for ((p, test, size, w), imps) in m {
        let head = format!("{p} {test}");
        if head != last {
            let what = match test.as_str() {
                "bw" => {
                    "unidirectional bandwidth, MB/s (median of reps; spread = (max-min)/median)"
                }
                "rate" => "message rate at 8 B, million messages/s",
                _ => "ping-pong latency, half round trip, us",
            };
            t.push_str(&format!(
                "\n{p}: {what}\n{:<9} {:>6} {:>11} {:>7} {:>11} {:>7} {:>10} {:>11} {:>10} {:>11} {:>10}\n",
                "size",
                "window",
                "raw",
                "spread",
                "weft",
                "spread",
                "weft/raw",
                "raw write",
                "weft/write",
                "weft put",
                "put/write"
            ));
            last = head;
        }
        let unit = match test.as_str() {
            "bw" => "MB/s",
            "rate" => "Mmsg/s",
            _ => "us",
        };
        let (rm, rlo, rhi) = stats(imps.get("raw").map_or(&[][..], |v| v));
        let (wm, wlo, whi) = stats(imps.get("weft").map_or(&[][..], |v| v));
        let ratio = wm / rm;
        let diff = if test == "lat" {
            format!("{:+.2} us", wm - rm)
        } else {
            format!("{ratio:.3}")
        };
        // Raw fi_writedata, the RDMA protocol's baseline (where measured).
        let (mm, mlo, mhi) = stats(imps.get("rma").map_or(&[][..], |v| v));
        let vs_write = if mm.is_nan() {
            "-".to_owned()
        } else if test == "lat" {
            format!("{:+.2} us", wm - mm)
        } else {
            format!("{:.3}", wm / mm)
        };
        // Weft's RMA put with a signal, against the same raw write.
        let (pm, plo, phi) = stats(imps.get("put").map_or(&[][..], |v| v));
        let put_vs_write = if pm.is_nan() || mm.is_nan() {
            "-".to_owned()
        } else if test == "lat" {
            format!("{:+.2} us", pm - mm)
        } else {
            format!("{:.3}", pm / mm)
        };
        t.push_str(&format!(
            "{:<9} {:>6} {:>11.3} {:>6.1}% {:>11.3} {:>6.1}% {:>10} {:>11.3} {:>10} {:>11.3} {:>10}\n",
            human(*size),
            w,
            rm,
            (rhi - rlo) / rm * 100.0,
            wm,
            (whi - wlo) / wm * 100.0,
            diff,
            mm,
            vs_write,
            pm,
            put_vs_write
        ));
        for (imp, (med, lo, hi), n) in [
            ("raw", (rm, rlo, rhi), imps.get("raw").map_or(0, Vec::len)),
            ("rma", (mm, mlo, mhi), imps.get("rma").map_or(0, Vec::len)),
            ("weft", (wm, wlo, whi), imps.get("weft").map_or(0, Vec::len)),
            ("put", (pm, plo, phi), imps.get("put").map_or(0, Vec::len)),
        ] {
            if n == 0 {
                continue;
            }
            csv.push_str(&format!(
                "{p},{test},{size},{w},{imp},{unit},{med:.4},{lo:.4},{hi:.4},{n},{ratio:.4}\n"
            ));
        }
    }
    (t, csv)
}

/// Bandwidth vs size, raw and Weft, one line each per provider (largest window).
pub(super) fn plot(
    m: &BTreeMap<Key, BTreeMap<String, Vec<f64>>>,
    path: &Path,
    title: &str,
) -> Res<()> {
    use plotters::prelude::*;
    let font = std::fs::read("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf").map_err(|e| {
        format!("the plot needs DejaVuSans.ttf ({e}): install fonts-dejavu-core (./weft setup)")
    })?;
    plotters::style::register_font(
        "sans-serif",
        FontStyle::Normal,
        Box::leak(font.into_boxed_slice()),
    )
    .map_err(|_| "cannot use DejaVuSans.ttf as a font")?;
    let wmax = m
        .keys()
        .filter(|k| k.1 == "bw")
        .map(|k| k.3)
        .max()
        .unwrap_or(1);
    let mut series: BTreeMap<(String, String), Vec<(f64, f64)>> = BTreeMap::new();
    for ((p, test, size, w), imps) in m {
        if test != "bw" || *w != wmax {
            continue;
        }
        for (imp, v) in imps {
            series
                .entry((p.clone(), imp.clone()))
                .or_default()
                .push((*size as f64, stats(v).0));
        }
    }
    let (xmin, xmax) = series
        .values()
        .flatten()
        .fold((f64::MAX, 1.0f64), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let ymax = series.values().flatten().fold(1.0f64, |a, p| a.max(p.1));
    let ymin = series
        .values()
        .flatten()
        .fold(f64::MAX, |a, p| a.min(p.1))
        .max(1e-3);
    let root = BitMapBackend::new(path, (1000, 620)).into_drawing_area();
    let e = |e: &dyn std::fmt::Display| format!("plot: {e}");
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(
            (xmin..xmax * 1.2).log_scale(),
            (ymin * 0.8..ymax * 1.5).log_scale(),
        )
        .map_err(|x| e(&x))?;
    chart
        .configure_mesh()
        .x_desc("message size (bytes)")
        .y_desc(format!("bandwidth, MB/s (window {wmax})"))
        .x_label_formatter(&|x| decimal(*x))
        .draw()
        .map_err(|x| e(&x))?;
    let colours = [RED, BLUE, GREEN, MAGENTA, CYAN, BLACK];
    for (i, ((p, imp), pts)) in series.iter().enumerate() {
        let c = colours[(i / 2) % colours.len()];
        let style = if imp == "raw" {
            c.mix(0.45).stroke_width(3)
        } else {
            c.stroke_width(2)
        };
        chart
            .draw_series(LineSeries::new(pts.clone(), style))
            .map_err(|x| e(&x))?
            .label(format!("{p} {imp}"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
        chart
            .draw_series(pts.iter().map(|&(x, y)| Circle::new((x, y), 3, c.filled())))
            .map_err(|x| e(&x))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|x| e(&x))?;
    root.present().map_err(|x| e(&x))?;
    Ok(())
}
