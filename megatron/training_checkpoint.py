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


PREDICTED = "model_predicted"
"""Payload key of a --2bw-mitigation predict run's newest buffer, P(W(t)) (per rank's
stage and tensor shard; tools/checkpoint_util.py drops it, and a resume then predicts
again from the true weights)."""
TRUE_WEIGHTS = "model_is_true_weights"
"""Payload flag: ``model`` holds the true weights of a predict run.  Checkpoints of
predict runs saved before 2026-12-08 lack it: their ``model`` is the prediction."""


def _module_state(engine: PipelineEngine) -> Dict[str, Any]:
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def model_states(engine: PipelineEngine
                 ) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]], Optional[Dict[str, Any]]]:
    """(newest weights, 2BW shadow weights or None, predicted newest weights or None) as
    module state dicts.

    Under ``--2bw-mitigation predict`` the newest buffer holds the prediction P(W(t)),
    not W(t): the first entry is then the true W(t) (what evaluation sees, and what a
    run under other flags, a finetuning run or an export must start from), and the third
    the buffer as it is, which a resume under predict loads to continue bit for bit."""
    engine.optimizer.wait_gathers()  # --overlap-param-gather: none may still be in flight
    w = engine.weights
    w.install(engine.latest_buffer)
    latest = _module_state(engine)
    predicted = None
    if getattr(engine.optimizer, "prediction", None) is not None:
        predicted = latest
        # the context puts the buffer's bits back after: saving leaves the run untouched
        with engine.optimizer.true_weights(w.params(engine.latest_buffer)):
            latest = _module_state(engine)
    shadow = None
    if w.num_buffers == 2:
        w.install(engine.shadow_buffer)
        shadow = _module_state(engine)
        w.install(engine.latest_buffer)
    return latest, shadow, predicted


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


def mitigation_change_note(cfg: MegatronConfig, saved_parallel: Dict[str, Any],
                           iteration: int) -> Optional[str]:
    """A note when a 2BW run resumes a 2BW checkpoint under another --2bw-mitigation
    (allowed: each mitigation reads only the weights and optimizer state every 2BW
    checkpoint holds), saying where the new one starts; else None."""
    par = cfg.parallel
    old, new = saved_parallel.get("tbw_mitigation"), par.tbw_mitigation
    if (par.pipeline_schedule != "2bw" or saved_parallel.get("pipeline_schedule") != "2bw"
            or old is None or old == new):
        return None
    n = par.tbw_flush_warmup_iters
    if new == "warmup":
        what = (f"iterations {iteration} to {n - 1} run under Flush, since the warm-up counts "
                f"from iteration 0 (--2bw-flush-warmup-iters {n}), then 2BW"
                if iteration < n else
                f"its warm-up of {n} iterations (counted from iteration 0) is already over, so "
                f"2BW goes on")
    elif new == "predict":
        what = ("the batch after the resume runs on the checkpoint's older version as it is; "
                "the prediction starts with the first step taken here")
    else:
        what = "the two weight versions carry over as they are"
    if old == "predict":
        what += " (the newest weights are the trained ones, not their prediction)"
    return (f"note: the checkpoint was trained with --2bw-mitigation {old}, this run uses "
            f"{new}: {what}")


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


def seed_note(cfg: MegatronConfig, saved_training: Dict[str, Any],
              consumed_samples: int) -> Optional[str]:
    """A warning when a run resumes with another --seed than the checkpoint's: the order
    of the training samples follows it, so the data position no longer continues the
    checkpoint's run; else None.  (The RNG streams themselves come from the checkpoint.)"""
    old, new = saved_training.get("seed"), cfg.training.seed
    if old is None or old == new or not consumed_samples:
        return None
    return (f"warning: the checkpoint was trained with --seed {old}, this run uses {new}: the "
            f"order of the training samples follows --seed, so its data position "
            f"({consumed_samples} consumed samples) does not continue where the checkpoint's "
            f"run stopped (samples are read again or skipped); pass --seed {old} to continue it")


def _saved_by_predict(payload: Dict[str, Any], saved_config: Dict[str, Any]) -> bool:
    par = saved_config.get("parallel") or {}
    optim = payload.get("optimizer")
    return ((par.get("tbw_mitigation") == "predict" and par.get("pipeline_schedule") == "2bw")
            or (isinstance(optim, dict) and optim.get("weight_prediction") is not None))


def _predicted_weights_note(payload: Dict[str, Any], saved_config: Dict[str, Any],
                            load: str) -> Optional[str]:
    """A warning for a checkpoint of a --2bw-mitigation predict run saved before its
    ``model`` held the true weights, loaded where the prediction is not restored; else
    None."""
    if payload.get(TRUE_WEIGHTS) or not _saved_by_predict(payload, saved_config):
        return None
    return (f"warning: --load {load} was saved by a --2bw-mitigation predict run before "
            f"2026-12-08: its weights are the predicted ones, P(W), which differ from the "
            f"trained weights by about one optimizer step; resume it with --2bw-mitigation "
            f"predict (and its optimizer state) to continue exactly")


def _load_weights(cfg: MegatronConfig, engine: PipelineEngine, optimizer,
                  payload: Dict[str, Any], saved_config: Dict[str, Any]) -> bool:
    """Load the checkpoint's weight versions into the engine's buffers; True when the
    newest buffer holds true weights that ``--2bw-mitigation predict`` must predict
    again once the optimizer state is loaded (a converted checkpoint, which carries no
    predicted copy).

    A predict run that restores its optimizer state continues from the saved prediction
    (bit for bit); every other run starts from the true weights."""
    tr = cfg.training
    source = f"--load {tr.load}"
    optim = payload.get("optimizer")
    resumes_prediction = (getattr(optimizer, "prediction", None) is not None
                          and not tr.no_load_optim and isinstance(optim, dict)
                          and optim.get("weight_prediction") is not None)
    latest, repredict = payload["model"], False
    if resumes_prediction and payload.get(TRUE_WEIGHTS):
        if payload.get(PREDICTED) is not None:
            latest = payload[PREDICTED]
        else:
            repredict = True
    elif not resumes_prediction:
        note = _predicted_weights_note(payload, saved_config, tr.load)
        if note:
            print_rank_last(note)
    load_model_states(engine, latest, payload.get("model_shadow"), source=source)
    return repredict


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
        note = _predicted_weights_note(payload, payload.get("config") or {}, tr.load)
        if note:
            print_rank_last(note)
        load_model_states(engine, payload["model"], None, strict=False,
                           source=f"--load {tr.load}")
        optimizer.reload_model_params(engine.weights.params(engine.latest_buffer))
        print_rank_last(f"loaded weights of iteration {payload['iteration']} from {tr.load} "
                        "for finetuning (iteration, optimizer and data position reset)")
        return state
    saved_config = payload.get("config") or {}
    for note in (schedule_change_note(cfg, saved_config.get("parallel") or {}),
                 warmup_switch_note(cfg, saved_config.get("parallel") or {}, payload["iteration"]),
                 mitigation_change_note(cfg, saved_config.get("parallel") or {},
                                        payload["iteration"]),
                 seq_length_note(cfg, saved_config.get("model") or {},
                                 payload["consumed_train_samples"]),
                 seed_note(cfg, saved_config.get("training") or {},
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
    repredict = _load_weights(cfg, engine, optimizer, payload, saved_config)
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
        kept = getattr(optimizer, "load_notes", None)
        if kept:
            print_rank_last(f"note: the optimizer state of --load {tr.load} keeps its own "
                            f"{', '.join(kept)}, as Megatron-LM does; --no-load-optim starts "
                            f"the optimizer afresh with this run's")
        if repredict:
            optimizer.predict_latest(engine.weights.params(engine.latest_buffer))
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
        notes = getattr(scheduler, "load_notes", None)
        if notes:
            flag, whose = (("--use-checkpoint-opt_param-scheduler", "the checkpoint's")
                           if oc.use_checkpoint_opt_param_scheduler else
                           ("--override-opt_param-scheduler", "this run's"))
            print_rank_last(f"note: {flag}: the LR and weight-decay schedule keeps {whose} "
                            f"values where the two differ: {'; '.join(notes)}")
    if not tr.no_load_rng and payload.get("rng_state") is not None:
        try:
            set_rng_state(payload["rng_state"])
        except _RESTORE_ERRORS as exc:
            raise CheckpointError(f"--load {tr.load}: cannot restore the random number "
                                  f"generator state of iteration {state.iteration}: {exc} "
                                  f"(--no-load-rng skips it)") from None
    print_rank_last(f"resumed from {tr.load} at iteration {state.iteration}"
                    + _taken_text(cfg, payload, state))
    return state


def _taken_text(cfg: MegatronConfig, payload: Dict[str, Any], state: TrainState) -> str:
    """What a resume took from the checkpoint and what it left, for its log line."""
    tr = cfg.training
    taken = ["weights" + (" (both 2BW versions)" if _two_versions(cfg, payload) else ""),
             f"data position ({state.consumed_train_samples} samples)"]
    left = []
    if tr.no_load_optim:
        left.append("optimizer state (--no-load-optim)")
    elif payload.get("optimizer") is not None:
        taken.append("optimizer state")
    if payload.get("lr_scheduler") is not None and not tr.skip_train:
        taken.append("LR schedule")
    if tr.no_load_rng:
        left.append("RNG state (--no-load-rng)")
    elif payload.get("rng_state") is not None:
        taken.append("RNG state")
    return (f": took its {', '.join(taken)}"
            + (f"; not loaded: {', '.join(left)}" if left else ""))


def _two_versions(cfg: MegatronConfig, payload: Dict[str, Any]) -> bool:
    """Whether a resume loads two weight versions (2BW here and in the checkpoint)."""
    return cfg.parallel.pipeline_schedule == "2bw" and payload.get("model_shadow") is not None


def save(cfg: MegatronConfig, groups: ParallelGroups, engine: PipelineEngine, optimizer,
         scheduler, state: TrainState) -> None:
    from megatron.tensor_parallel.random import get_rng_state

    latest, shadow, predicted = model_states(engine)
    extra = {"config": cfg.to_dict(), "engine": engine.state_dict(),
             "schedule": cfg.parallel.pipeline_schedule}
    if predicted is not None:  # "model" holds the true weights (see model_states)
        extra.update({PREDICTED: predicted, TRUE_WEIGHTS: True})
    path = save_checkpoint(cfg.training.save, state, groups, model_state=latest,
                           shadow_state=shadow, optimizer=optimizer, scheduler=scheduler,
                           rng_state=get_rng_state(),
                           save_optim=not cfg.training.no_save_optim,
                           stage_layers=cfg.parallel.stage_layers(cfg.model.num_layers,
                                                                  groups.pp_rank),
                           extra=extra)
    print_rank_last(f"saved checkpoint of iteration {state.iteration} to {path}")
