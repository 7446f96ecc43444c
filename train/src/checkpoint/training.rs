//! What of a training run goes into a checkpoint, and when: at the end of an epoch, and in the
//! middle of one (`--checkpoint-every`, a stop signal) at the same step on every rank.

use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use burn_dist::{CollectiveBackend, average_buffers};

use super::writer::BackgroundWriter;
use super::{CheckpointHeader, encode, model_fingerprint, path_at, prune, read};
use crate::TrainError;
use crate::cli::TrainArgs;
use crate::metrics::EpochMetrics;
use crate::preemption::MidEpoch;
use crate::trainer::{RunContext, TrainState};

/// A checkpoint in the middle of an epoch, at the same step on every rank: the BatchNorm
/// statistics (the model's and the EMA's) are averaged across ranks first, as at the end of an
/// epoch, since the file holds one copy and every rank resumes from it. The running statistics
/// are affine in their previous value with the same factor on every rank, so averaging earlier
/// gives the end of the epoch the same average (to rounding); a run with and one without
/// `--checkpoint-every` differ by that rounding only.
pub fn save_mid_epoch<B, M>(
    ctx: &RunContext,
    state: &mut TrainState<B, M>,
    history: &[EpochMetrics],
    at: MidEpoch,
    writer: &mut BackgroundWriter,
) -> Result<(), TrainError>
where
    B: AutodiffBackend + CollectiveBackend,
    B::InnerBackend: CollectiveBackend,
    M: AutodiffModule<B>,
{
    state.model = average_buffers::<B, _>(ctx.comm(), state.model.clone())?;
    if let Some(ema) = state.ema.as_mut() {
        ema.model = average_buffers::<B::InnerBackend, _>(ctx.comm(), ema.model.clone())?;
    }
    if ctx.is_main() {
        save(
            &ctx.args,
            ctx.dist.world_size(),
            state,
            history,
            Some(at),
            writer,
        )?;
    }
    Ok(())
}

/// Copies the checkpoint of the epoch `history` ends with (or, with `mid_epoch`, of a position
/// in the next one) to host memory, then writes it on `writer`'s thread: written, read back, and
/// only then older ones pruned (`--keep-checkpoints`), so that a bad write never costs the
/// fallback.
pub fn save<B, M>(
    args: &TrainArgs,
    world_size: usize,
    state: &TrainState<B, M>,
    history: &[EpochMetrics],
    mid_epoch: Option<MidEpoch>,
    writer: &mut BackgroundWriter,
) -> Result<(), TrainError>
where
    B: AutodiffBackend,
    B::InnerBackend: CollectiveBackend,
    M: AutodiffModule<B>,
{
    let epoch = history.last().map_or(0, |m| m.epoch);
    let header = CheckpointHeader {
        epoch,
        args: args.clone(),
        world_size,
        data_seed: args.seed,
        model_fingerprint: model_fingerprint(&state.model),
        sections: Vec::new(),
        history: history.to_vec(),
        ema_n_averaged: state.ema.as_ref().map(|ema| ema.n_averaged),
        mid_epoch,
    };
    let position = header.position();
    let encoded = encode(
        &path_at(args, position),
        header,
        &state.model,
        state.optimizer.inner(),
        state.ema.as_ref().map(|ema| &ema.model),
    )?;
    let args = args.clone();
    writer.submit(Box::new(move || {
        let path = encoded.path().to_path_buf();
        encoded.write()?;
        match read(&path) {
            Ok(_) => {
                for removed in prune(&args, position) {
                    println!("removed old checkpoint {}", removed.display());
                }
            }
            Err(error) => {
                println!("warning: {error} right after writing it; older checkpoints kept")
            }
        }
        Ok(())
    }))?;
    Ok(())
}
