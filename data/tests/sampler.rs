//! DistributedSampler against torch's semantics.

use std::collections::HashMap;

use data::DistributedSampler;

fn all_ranks(
    len: usize,
    world: usize,
    drop_last: bool,
    shuffle: bool,
    epoch: u64,
) -> Vec<Vec<(usize, bool)>> {
    (0..world)
        .map(|r| {
            let mut s = DistributedSampler::new(len, world, r)
                .expect("valid")
                .with_drop_last(drop_last)
                .with_shuffle(shuffle)
                .with_seed(42);
            s.set_epoch(epoch);
            s.indices()
                .iter()
                .map(|p| (p.index, p.is_padding))
                .collect()
        })
        .collect()
}

fn plain(v: &[Vec<(usize, bool)>]) -> Vec<Vec<usize>> {
    v.iter().map(|r| r.iter().map(|p| p.0).collect()).collect()
}

#[test]
fn matches_torch_without_shuffle() {
    // Produced by torch.utils.data.DistributedSampler(range(n), num_replicas=w, rank=r,
    // shuffle=False, drop_last=dl) with torch 2.x.
    let cases: [(usize, usize, bool, Vec<Vec<usize>>); 5] = [
        (
            10,
            4,
            false,
            vec![vec![0, 4, 8], vec![1, 5, 9], vec![2, 6, 0], vec![3, 7, 1]],
        ),
        (
            3,
            8,
            false,
            vec![
                vec![0],
                vec![1],
                vec![2],
                vec![0],
                vec![1],
                vec![2],
                vec![0],
                vec![1],
            ],
        ),
        (
            10,
            4,
            true,
            vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]],
        ),
        (7, 3, true, vec![vec![0, 3], vec![1, 4], vec![2, 5]]),
        (
            5,
            5,
            false,
            vec![vec![0], vec![1], vec![2], vec![3], vec![4]],
        ),
    ];
    for (n, w, dl, want) in cases {
        assert_eq!(
            plain(&all_ranks(n, w, dl, false, 0)),
            want,
            "n={n} w={w} drop_last={dl}"
        );
    }
    // Padding flags: the wrap-around positions of (10, 4) are rank 2's and rank 3's last ones.
    let r = all_ranks(10, 4, false, false, 0);
    let pads: Vec<bool> = r.iter().map(|x| x[2].1).collect();
    assert_eq!(pads, [false, false, true, true]);
}

#[test]
fn every_index_once_per_epoch_plus_padding() {
    for (len, world) in [(103, 4), (100, 4), (5, 8), (1000, 7)] {
        let ranks = all_ranks(len, world, false, true, 3);
        let per_rank = len.div_ceil(world);
        assert!(ranks.iter().all(|r| r.len() == per_rank), "equal counts");
        let mut real = HashMap::new();
        let mut padding = 0;
        for r in &ranks {
            for &(i, pad) in r {
                if pad {
                    padding += 1;
                } else {
                    *real.entry(i).or_insert(0) += 1;
                }
            }
        }
        assert_eq!(real.len(), len, "every index appears");
        assert!(
            real.values().all(|&c| c == 1),
            "exactly once among non-padding"
        );
        assert_eq!(padding, per_rank * world - len);
    }
}

#[test]
fn epochs_differ_and_ranks_agree() {
    let e0 = all_ranks(200, 4, false, true, 0);
    let e1 = all_ranks(200, 4, false, true, 1);
    assert_ne!(plain(&e0), plain(&e1));
    assert_eq!(
        plain(&e0),
        plain(&all_ranks(200, 4, false, true, 0)),
        "deterministic"
    );
    // Ranks build the same global permutation: interleaving rank lists recovers it.
    let s = DistributedSampler::new(200, 4, 0)
        .expect("valid")
        .with_seed(42);
    let global: Vec<usize> = s.global_indices().iter().map(|p| p.index).collect();
    for (r, list) in e0.iter().enumerate() {
        for (k, &(i, _)) in list.iter().enumerate() {
            assert_eq!(global[r + 4 * k], i);
        }
    }
    let mut sorted = global.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..200).collect::<Vec<_>>(), "a permutation");
    assert_ne!(global, (0..200).collect::<Vec<_>>(), "shuffled");
}

#[test]
fn shuffled_padding_repeats_the_start_of_the_permutation() {
    let s = DistributedSampler::new(10, 4, 0)
        .expect("valid")
        .with_seed(7);
    let g = s.global_indices();
    assert_eq!(g.len(), 12);
    assert_eq!(g[10].index, g[0].index);
    assert_eq!(g[11].index, g[1].index);
    assert!(g[10].is_padding && g[11].is_padding && !g[9].is_padding);
}
