"""The trainer's side of checkpoints: resume or finetune from ``--load``, save to ``--save``.

``megatron.checkpointing`` owns the files (layout, safetensors + JSON, manifest, atomic
writes); this module moves the engine's state in and out of them: the newest weights and,
under 2BW, the older version in the second buffer; the optimizer, LR/weight-decay
schedule, engine and RNG states; and the notes a resume under other flags prints.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from megatron.checkpoint_load import load_for_run
from megatron.checkpoint_shape import check_state_fits
from megatron.checkpointing import TrainState, save_checkpoint
from megatron.config import MegatronConfig
from megatron.errors import CheckpointError, alike_on_every_rank
from megatron.parallel_state import ParallelGroups
from megatron.pipeline.engine import PipelineEngine
from megatron.training_log import print_rank_last


def model_states(engine: PipelineEngine) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
    """(newest weights, 2BW shadow weights or None) as module state dicts."""
    engine.optimizer.wait_gathers()  # --overlap-param-gather: none may still be in flight
    w = engine.weights
    w.install(engine.latest_buffer)
    latest = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    shadow = None
    if w.num_buffers == 2:
        w.install(engine.shadow_buffer)
        shadow = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
        w.install(engine.latest_buffer)
    return latest, shadow


def load_model_states(engine: PipelineEngine, latest: Dict[str, Any],
                       shadow: Optional[Dict[str, Any]], strict: bool = True,
                       source: str = "checkpoint") -> None:
    w = engine.weights
    w.install(engine.latest_buffer)
    check_state_fits(source, latest, engine.model, strict)
    engine.model.load_state_dict(latest, strict=strict)
    if w.num_buffers == 2:
        if shadow is not None and engine.shadow_buffer != engine.latest_buffer:
            w.install(engine.shadow_buffer)
            check_state_fits(source, shadow, engine.model, strict)
            engine.model.load_state_dict(shadow, strict=strict)
            w.install(engine.latest_buffer)
        else:
            w.sync_all_from(engine.latest_buffer)


def warmup_switch_note(cfg: MegatronConfig, saved_parallel: Dict[str, Any],
                       iteration: int) -> Optional[str]:
    """A warning when a resumed ``--2bw-mitigation warmup`` run switches from Flush to 2BW
    at another iteration than the checkpoint's run (the default length is half of
    --train-iters, so a resume with a longer --train-iters moves it); else None."""
    par = cfg.parallel
    if par.tbw_mitigation != "warmup" or saved_parallel.get("tbw_mitigation") != "warmup":
        return None
    old, new = saved_parallel.get("tbw_flush_warmup_iters"), par.tbw_flush_warmup_iters
    if old is None or old == new:
        return None
    again = (f"; iterations {iteration} to {new - 1} run under Flush again"
             if old <= iteration < new else "")
    return (f"warning: the checkpoint's run switches from Flush to 2BW at iteration {old}, "
            f"this one at {new} (--2bw-flush-warmup-iters; by default half of "
            f"--train-iters){again}; pass --2bw-flush-warmup-iters {old} to keep the "
            f"checkpoint's switch")


def schedule_change_note(cfg: MegatronConfig, saved_parallel: Dict[str, Any]) -> Optional[str]:
    """A note when a run resumes a checkpoint under another --pipeline-schedule (allowed:
    the weights, optimizer and data position carry over); else None."""
    old, new = saved_parallel.get("pipeline_schedule"), cfg.parallel.pipeline_schedule
    if old is None or old == new:
        return None
    if old == "2bw":
        what = "training goes on from its newest weights; the older version 2BW kept is dropped"
    elif new == "2bw":
        what = "both 2BW weight versions start from its weights"
    else:
        what = "both have vanilla semantics, so only the speed and memory change"
    return (f"note: the checkpoint was trained with --pipeline-schedule {old}, this run "
            f"uses {new}: {what}")


def seq_length_note(cfg: MegatronConfig, saved_model: Dict[str, Any],
                    consumed_samples: int) -> Optional[str]:
    """A warning when a run resumes with another --seq-length than the checkpoint's (the
    model loads: the position table is --max-position-embeddings); else None."""
    old, new = saved_model.get("seq_length"), cfg.model.seq_length
    if old is None or old == new:
        return None
    return (f"warning: the checkpoint was trained with --seq-length {old}, this run uses {new}: "
            f"its data position ({consumed_samples} consumed samples) counts samples of {old} "
            "tokens, so the training data does not continue where the checkpoint's run stopped")


# What restoring a saved optimizer or RNG state raises when it does not fit this run
_RESTORE_ERRORS = (ValueError, KeyError, TypeError, IndexError, AttributeError, RuntimeError)


def maybe_load(cfg: MegatronConfig, groups: ParallelGroups, engine: PipelineEngine,
               optimizer, scheduler) -> TrainState:
    from megatron.tensor_parallel.random import set_rng_state

    tr = cfg.training
    state = TrainState()
    if not tr.load:
        return state
    payload, message = load_for_run(
        tr.load, groups, cfg.model, allow_unsafe=tr.allow_unsafe_checkpoint,
        stage_layers=cfg.parallel.stage_layers(cfg.model.num_layers, groups.pp_rank),
        split=(cfg.parallel.decoder_first_pipeline_num_layers,
               cfg.parallel.decoder_last_pipeline_num_layers))
    if message:
        print_rank_last(message)
    if payload is None:
        return state
    if tr.finetune:
        load_model_states(engine, payload["model"], None, strict=False,
                           source=f"--load {tr.load}")
        optimizer.reload_model_params(engine.weights.params(engine.latest_buffer))
        print_rank_last(f"loaded weights of iteration {payload['iteration']} from {tr.load} "
                        "for finetuning (iteration, optimizer and data position reset)")
        return state
    saved_config = payload.get("config") or {}
    for note in (schedule_change_note(cfg, saved_config.get("parallel") or {}),
                 warmup_switch_note(cfg, saved_config.get("parallel") or {}, payload["iteration"]),
                 seq_length_note(cfg, saved_config.get("model") or {},
                                 payload["consumed_train_samples"])):
        if note:
            print_rank_last(note)
    state = TrainState(iteration=payload["iteration"],
                       consumed_train_samples=payload["consumed_train_samples"],
                       consumed_valid_samples=payload["consumed_valid_samples"])
    engine.set_iteration(state.iteration)
    if (engine.weights.num_buffers == 2 and payload.get("model_shadow") is None
            and state.iteration > engine.flush_warmup_iters):
        # One weight version (a Flush run's checkpoint): 2BW restarts from W(t), as
        # after a flush warm-up of t batches, so batches t and t+1 both use (and are
        # reported at) version t.
        engine.flush_warmup_iters = state.iteration
    load_model_states(engine, payload["model"], payload.get("model_shadow"),
                       source=f"--load {tr.load}")
    if not tr.no_load_optim and payload.get("optimizer") is None and state.iteration > 0:
        # (an imported checkpoint, at iteration 0, has none to give: a fresh optimizer)
        raise CheckpointError(
            f"--load {tr.load}: the checkpoint of iteration {state.iteration} holds no "
            f"optimizer state (saved with --no-save-optim?); resuming would restart the "
            f"optimizer's moments silently: pass --no-load-optim to resume with a fresh "
            f"optimizer, or --finetune to start a new run from its weights")
    if not tr.no_load_optim and payload.get("optimizer") is not None:
        try:
            optimizer.load_state_dict(payload["optimizer"])
        except _RESTORE_ERRORS as exc:  # another optimizer/precision, or a malformed state
            raise CheckpointError(f"--load {tr.load}: cannot restore the optimizer state of "
                                  f"iteration {state.iteration}: {exc} (--no-load-optim starts "
                                  f"the optimizer afresh)") from None
        if payload.get("engine") is not None:
            try:
                engine.load_state_dict(payload["engine"])
            except _RESTORE_ERRORS as exc:  # a malformed file: name what it held
                raise CheckpointError(
                    f"--load {tr.load}: cannot restore the pipeline engine's state of "
                    f"iteration {state.iteration} (its iteration and the loss scales of the "
                    f"batches in flight): {type(exc).__name__}: {exc} (--no-load-optim starts "
                    f"the optimizer and these afresh)") from None
    else:
        optimizer.reload_model_params(engine.weights.params(engine.latest_buffer))
        engine.set_iteration(state.iteration)
    # evaluation only (--skip-train) takes no step: the schedule is neither compared with
    # this run's flags nor adopted (a checkpoint trained with --decoupled-lr, say, must
    # evaluate without it)
    if payload.get("lr_scheduler") is not None and not tr.skip_train:
        oc = cfg.optimizer
        batch_sizes = tr.batch_sizes()
        try:
            scheduler.load_state_dict(payload["lr_scheduler"],
                                      override=oc.override_opt_param_scheduler,
                                      use_checkpoint=oc.use_checkpoint_opt_param_scheduler,
                                      samples_per_iteration=(
                                          state.consumed_train_samples / state.iteration
                                          if state.iteration else tr.global_batch_size),
                                      # batches of changing size: no one factor converts
                                      convert=(None if batch_sizes is None else (
                                          lambda n, unit: batch_sizes.samples_after(n)
                                          if unit == "samples" else batch_sizes.iterations(n))))
        except ValueError as exc:
            # every rank holds the same schedule and the same flags: one line per node
            raise alike_on_every_rank(CheckpointError(f"--load {tr.load}: {exc}")) from None
    if not tr.no_load_rng and payload.get("rng_state") is not None:
        try:
            set_rng_state(payload["rng_state"])
        except _RESTORE_ERRORS as exc:
            raise CheckpointError(f"--load {tr.load}: cannot restore the random number "
                                  f"generator state of iteration {state.iteration}: {exc} "
                                  f"(--no-load-rng skips it)") from None
    print_rank_last(f"resumed from {tr.load} at iteration {state.iteration}")
    return state


def save(cfg: MegatronConfig, groups: ParallelGroups, engine: PipelineEngine, optimizer,
         scheduler, state: TrainState) -> None:
    from megatron.tensor_parallel.random import get_rng_state

    latest, shadow = model_states(engine)
    path = save_checkpoint(cfg.training.save, state, groups, model_state=latest,
                           shadow_state=shadow, optimizer=optimizer, scheduler=scheduler,
                           rng_state=get_rng_state(),
                           save_optim=not cfg.training.no_save_optim,
                           stage_layers=cfg.parallel.stage_layers(cfg.model.num_layers,
                                                                  groups.pp_rank),
                           extra={"config": cfg.to_dict(), "engine": engine.state_dict(),
                                  "schedule": cfg.parallel.pipeline_schedule})
    print_rank_last(f"saved checkpoint of iteration {state.iteration} to {path}")
