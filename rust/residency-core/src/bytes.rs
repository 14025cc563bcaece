//! Byte counts as a person reads them in messages: the largest binary unit the count
//! reaches, to three significant digits at most, as `fhelium.residency.sizes.format_size`
//! writes them (docs/concepts/locations-and-budgets.md#byte-counts).

/// The binary units, largest first.
const UNITS: [(&str, u64); 5] = [
    ("PiB", 1 << 50),
    ("TiB", 1 << 40),
    ("GiB", 1 << 30),
    ("MiB", 1 << 20),
    ("KiB", 1 << 10),
];

/// `count` in the largest binary unit it reaches, to three significant digits at most:
/// `"6 MiB"`, `"256 KiB"`, `"1.5 GiB"`, `"17 bytes"`, `"1 byte"`.
pub fn format_size(count: u64) -> String {
    for (unit, scale) in UNITS {
        if count >= scale {
            // The scale is a power of two: the division adds no rounding of its own.
            #[allow(clippy::cast_precision_loss)]
            let shown = f64_to_3g(count as f64 / scale as f64);
            return format!("{shown} {unit}");
        }
    }
    if count == 1 {
        "1 byte".to_owned()
    } else {
        format!("{count} bytes")
    }
}

/// `count` for a message: the readable size and, when that is not a plain count of
/// bytes, the exact one (`"1.5 GiB (1610612736 bytes)"`, `"17 bytes"`).
pub fn format_size_exact(count: u64) -> String {
    if count < 1 << 10 {
        format_size(count)
    } else {
        format!("{} ({count} bytes)", format_size(count))
    }
}

/// Python's `f"{value:.3g}"` for a value of at least 1, written without an exponent
/// where that format would use one (the whole number instead, as `format_size` does).
fn f64_to_3g(value: f64) -> String {
    // The exponent of the value rounded to three significant digits.
    let scientific = format!("{value:.2e}");
    let exponent: i32 = scientific
        .split_once('e')
        .and_then(|(_, exponent)| exponent.parse().ok())
        .unwrap_or(0);
    if !(0..3).contains(&exponent) {
        return format!("{value:.0}");
    }
    let decimals = usize::try_from(2 - exponent).unwrap_or(0);
    let fixed = format!("{value:.decimals$}");
    if fixed.contains('.') {
        fixed.trim_end_matches('0').trim_end_matches('.').to_owned()
    } else {
        fixed
    }
}

#[cfg(test)]
mod tests {
    use super::{format_size, format_size_exact};

    #[test]
    fn counts_show_as_the_python_helper_shows_them() {
        for (count, shown) in [
            (0, "0 bytes"),
            (1, "1 byte"),
            (1023, "1023 bytes"),
            (1024, "1 KiB"),
            (256 << 10, "256 KiB"),
            (6 << 20, "6 MiB"),
            (3 << 29, "1.5 GiB"),
            (3 * 10_u64.pow(9), "2.79 GiB"),
            (u64::MAX, "16384 PiB"),
            (1023 << 10, "1023 KiB"),
            (1000 << 10, "1000 KiB"),
            (1536, "1.5 KiB"),
            (1_048_575, "1024 KiB"),
            (10_000_000, "9.54 MiB"),
            (100 << 20, "100 MiB"),
            (524_288, "512 KiB"),
        ] {
            assert_eq!(format_size(count), shown, "{count}");
        }
    }

    #[test]
    fn messages_carry_the_exact_count() {
        assert_eq!(format_size_exact(3 << 29), "1.5 GiB (1610612736 bytes)");
        assert_eq!(format_size_exact(17), "17 bytes");
    }
}
