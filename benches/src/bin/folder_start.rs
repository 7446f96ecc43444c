//! Start-up benchmark at ImageNet scale: how long it takes to know the dataset before the first
//! batch, on a generated tree of empty files named like ImageNet's train split (1000 class folders
//! `n0xxxxxxx` of 1,281 `n0xxxxxxx_<i>.JPEG` each: 1,281,000 files).
//!
//! ```text
//! cargo run --release -p benches --no-default-features --bin folder_start -- --rounds 3
//! python benches/compare_folder_start.py            # the same, beside torchvision's ImageFolder
//! ```
//!
//! Times, per round: a plain scan (`ImageFolder::new`, what every rank did before the index), the
//! first open through the index (scan + write), and a later open (index read and checked against
//! the folders' modification times: what every rank but one does, and every later run). The
//! files are empty: only the listing is measured, not decoding. The tree is in the page cache
//! after the first round (as on a machine that just ran a job); a cold network file system makes
//! the scan slower still and the read barely so.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Parser;
use data::{ImageFolder, IndexSource};

#[derive(Parser, Debug)]
#[command(about = "ImageFolder start-up: plain scan vs cached index, on a 1.28 M-file tree")]
struct Args {
    /// The tree (created when absent).
    #[arg(long, default_value = "target/bench-data/empty-imagenet-train")]
    root: PathBuf,
    /// Class folders.
    #[arg(long, default_value_t = 1000)]
    classes: usize,
    /// Files per class folder.
    #[arg(long, default_value_t = 1281)]
    per_class: usize,
    /// Rounds; the best of each measure is reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// One JSON line instead of the table.
    #[arg(long)]
    json: bool,
}

/// Creates the tree unless its last file exists already.
fn create_tree(args: &Args) -> Result<()> {
    let class = |c: usize| format!("n{:08}", 1_440_764 + c * 7);
    let last = args.root.join(class(args.classes - 1)).join(format!(
        "{}_{}.JPEG",
        class(args.classes - 1),
        args.per_class - 1
    ));
    if last.exists() {
        return Ok(());
    }
    eprintln!(
        "creating {} empty files in {}",
        args.classes * args.per_class,
        args.root.display()
    );
    for c in 0..args.classes {
        let dir = args.root.join(class(c));
        std::fs::create_dir_all(&dir).with_context(|| format!("mkdir {}", dir.display()))?;
        for i in 0..args.per_class {
            let path = dir.join(format!("{}_{i}.JPEG", class(c)));
            std::fs::File::create(&path).with_context(|| format!("create {}", path.display()))?;
        }
    }
    Ok(())
}

fn seconds<T>(f: impl FnOnce() -> Result<T>) -> Result<(f64, T)> {
    let start = Instant::now();
    let out = f()?;
    Ok((start.elapsed().as_secs_f64(), out))
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.classes == 0 || args.per_class == 0 || args.rounds == 0 {
        bail!("--classes, --per-class and --rounds must be at least 1");
    }
    create_tree(&args)?;
    let index_dir = args.root.with_extension("index");
    let (mut scan, mut first, mut read) = (f64::MAX, f64::MAX, f64::MAX);
    let mut files = 0;
    for _ in 0..args.rounds {
        let (s, folder) = seconds(|| Ok(ImageFolder::new(&args.root)?))?;
        files = folder.len();
        scan = scan.min(s);
        let _ = std::fs::remove_dir_all(&index_dir);
        let (s, (_, source)) = seconds(|| Ok(ImageFolder::with_index(&args.root, &index_dir)?))?;
        expect_source(&source, "first open", |s| {
            matches!(s, IndexSource::Scanned(_))
        })?;
        first = first.min(s);
        let (s, (folder, source)) =
            seconds(|| Ok(ImageFolder::with_index(&args.root, &index_dir)?))?;
        expect_source(&source, "second open", |s| {
            matches!(s, IndexSource::Read(_))
        })?;
        if folder.len() != files {
            bail!("the index holds {} files, the scan {files}", folder.len());
        }
        read = read.min(s);
    }
    if args.json {
        println!(
            "{}",
            serde_json::json!({"files": files, "scan_s": scan, "first_open_s": first,
                               "index_read_s": read})
        );
    } else {
        println!("{files} files in {}", args.root.display());
        println!("{:<34} {:>9}", "best of rounds", "seconds");
        println!("{:<34} {scan:>9.3}", "plain scan (ImageFolder::new)");
        println!("{:<34} {first:>9.3}", "first open: scan + write index");
        println!("{:<34} {read:>9.3}", "later open: read index");
        println!("scan / index read: {:.1}x", scan / read);
    }
    Ok(())
}

fn expect_source(
    source: &IndexSource,
    what: &str,
    ok: impl Fn(&IndexSource) -> bool,
) -> Result<()> {
    if ok(source) {
        Ok(())
    } else {
        bail!("{what}: unexpected {source:?}")
    }
}
