//! SLURM's compact notations: host lists (`gpu[01-04,07],cpu3`) and tasks per node (`4(x2),3`),
//! as `srun` sets them in `SLURM_JOB_NODELIST` and `SLURM_TASKS_PER_NODE`.

/// Most hosts a list may expand to (a typo such as `n[1-99999999]` must not exhaust memory).
const MAX_HOSTS: usize = 1 << 20;

/// Splits at the commas that are outside brackets.
fn top_level_items(list: &str) -> Result<Vec<&str>, String> {
    let mut items = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in list.char_indices() {
        match c {
            '[' if depth == 0 => depth = 1,
            '[' => return Err("nested brackets".into()),
            ']' if depth == 1 => depth = 0,
            ']' => return Err("a ']' without its '['".into()),
            ',' if depth == 0 => {
                items.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err("a '[' without its ']'".into());
    }
    items.push(&list[start..]);
    if items.iter().any(|h| h.trim().is_empty()) {
        return Err("an empty host name".into());
    }
    Ok(items.into_iter().map(str::trim).collect())
}

/// The numbers of one bracket, e.g. `01-04,07` → `01 02 03 04 07`, zero-padded as written.
fn bracket_numbers(spec: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for part in spec.split(',') {
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        if !digits(lo) || !digits(hi) {
            return Err(format!("{part:?} is not a number or a range of numbers"));
        }
        let (a, b): (u64, u64) = match (lo.parse(), hi.parse()) {
            (Ok(a), Ok(b)) => (a, b),
            _ => return Err(format!("{part:?} is out of range")),
        };
        if a > b {
            return Err(format!("the range {part:?} runs backwards"));
        }
        if (b - a) as usize >= MAX_HOSTS - out.len().min(MAX_HOSTS) {
            return Err(format!("more than {MAX_HOSTS} hosts"));
        }
        let width = lo.len();
        out.extend((a..=b).map(|n| format!("{n:0width$}")));
    }
    Ok(out)
}

/// Expands one host pattern: text with zero or more brackets, each a list of numbers.
fn expand_pattern(pattern: &str) -> Result<Vec<String>, String> {
    let mut hosts = vec![String::new()];
    let mut rest = pattern;
    while let Some(open) = rest.find('[') {
        let close = rest[open..]
            .find(']')
            .map(|c| open + c)
            .ok_or("a '[' without its ']'")?;
        let numbers = bracket_numbers(&rest[open + 1..close])?;
        if hosts.len().saturating_mul(numbers.len()) > MAX_HOSTS {
            return Err(format!("more than {MAX_HOSTS} hosts"));
        }
        let text = &rest[..open];
        hosts = hosts
            .iter()
            .flat_map(|h| numbers.iter().map(move |n| format!("{h}{text}{n}")))
            .collect();
        rest = &rest[close + 1..];
    }
    Ok(hosts.into_iter().map(|h| h + rest).collect())
}

/// Expands a SLURM host list in SLURM's order, e.g. `gpu[01-02,07],cpu3` → `gpu01 gpu02 gpu07 cpu3`.
///
/// # Errors
/// Why the list cannot be read (unbalanced brackets, a backwards range, ...).
pub(crate) fn expand_hostlist(list: &str) -> Result<Vec<String>, String> {
    let mut hosts = Vec::new();
    for item in top_level_items(list)? {
        hosts.extend(expand_pattern(item)?);
        if hosts.len() > MAX_HOSTS {
            return Err(format!("more than {MAX_HOSTS} hosts"));
        }
    }
    Ok(hosts)
}

/// Expands SLURM's tasks per node, e.g. `4(x2),3` → `4 4 3`.
///
/// # Errors
/// Why the value cannot be read.
pub(crate) fn tasks_per_node(spec: &str) -> Result<Vec<usize>, String> {
    let mut out = Vec::new();
    for part in spec.split(',').map(str::trim) {
        let (count, repeat) = match part.split_once('(') {
            Some((count, rest)) => {
                let times = rest
                    .strip_prefix('x')
                    .and_then(|r| r.strip_suffix(')'))
                    .ok_or_else(|| format!("{part:?} is not of the form N(xM)"))?;
                let times: usize = times
                    .parse()
                    .map_err(|_| format!("{part:?}: {times:?} is not a count"))?;
                (count, times)
            }
            None => (part, 1),
        };
        let count: usize = count
            .parse()
            .map_err(|_| format!("{part:?}: {count:?} is not a number of tasks"))?;
        if repeat > MAX_HOSTS - out.len().min(MAX_HOSTS) {
            return Err(format!("more than {MAX_HOSTS} nodes"));
        }
        out.extend(std::iter::repeat_n(count, repeat));
    }
    Ok(out)
}

/// The rendezvous port of a SLURM job: every task derives the same one from the job id without
/// talking, and jobs sharing a node get different ones (the last four digits, from 15000, as
/// PyTorch Lightning's SLURM environment does).
///
/// # Errors
/// The job id is not a number.
pub(crate) fn port_from_job_id(job_id: &str) -> Result<u16, String> {
    let id: u64 = job_id
        .trim()
        .parse()
        .map_err(|_| format!("{job_id:?} is not a number"))?;
    Ok(15000 + (id % 10000) as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(list: &str) -> Vec<String> {
        expand_hostlist(list).unwrap_or_else(|e| panic!("{list}: {e}"))
    }

    #[test]
    fn host_lists_expand_as_slurm_writes_them() {
        assert_eq!(
            hosts("gpu[01-04,07],cpu3"),
            ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu3"]
        );
        assert_eq!(hosts("node7"), ["node7"]);
        assert_eq!(hosts("a[08-10]"), ["a08", "a09", "a10"]);
        assert_eq!(hosts("a[9-11]"), ["a9", "a10", "a11"]);
        assert_eq!(hosts("n[1-2]-ib,login"), ["n1-ib", "n2-ib", "login"]);
        assert_eq!(
            hosts("r[1-2]n[3,5]"),
            ["r1n3", "r1n5", "r2n3", "r2n5"],
            "several brackets: every combination"
        );
        assert_eq!(hosts("10.0.0.1"), ["10.0.0.1"]);
    }

    #[test]
    fn bad_host_lists_say_what_is_wrong() {
        for (list, what) in [
            ("gpu[01-04", "without its ']'"),
            ("gpu01-04]", "without its '['"),
            ("gpu[04-01]", "backwards"),
            ("gpu[a-b]", "not a number"),
            ("gpu[1,,2]", "not a number"),
            ("a,,b", "empty host"),
            ("n[[1]]", "nested"),
            ("n[1-99999999]", "more than"),
        ] {
            let e = expand_hostlist(list).expect_err(list);
            assert!(e.contains(what), "{list}: {e}");
        }
    }

    #[test]
    fn tasks_per_node_expand_repeats() {
        assert_eq!(tasks_per_node("4(x2),3").expect("valid"), [4, 4, 3]);
        assert_eq!(tasks_per_node("2").expect("valid"), [2]);
        assert_eq!(tasks_per_node("1(x3)").expect("valid"), [1, 1, 1]);
        for bad in ["4(2)", "x", "4(x)", "", "4(x2", "-1"] {
            assert!(tasks_per_node(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_port_follows_the_job_id() {
        assert_eq!(port_from_job_id("123456").expect("id"), 18456);
        assert_eq!(port_from_job_id("7").expect("id"), 15007);
        assert!(port_from_job_id("12_3").is_err());
    }
}
