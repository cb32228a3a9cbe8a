"""Validated flags -> the typed configs of ``megatron/config.py``, one builder per section.

``megatron.arguments.build_config`` assembles their results into a ``MegatronConfig``;
each reads the namespace ``megatron.argument_checks.validate_args`` completed (its
derived values included) and nothing else.
"""
from __future__ import annotations

import argparse

from megatron.argument_checks.errors import flag_of, require
from megatron.config import (
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    ProfileOptions,
    TensorBoardOptions,
    TrainingConfig,
)


def model_config(args: argparse.Namespace) -> ModelConfig:
    """The transformer's shape and block options; ``padded_vocab_size`` stays 0 (the
    trainer fills it once the tokenizer exists).  Entry-point flags (BERT's
    ``num_tokentypes``) are picked up when present."""
    model = ModelConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
        seq_length=args.seq_length, max_position_embeddings=args.max_position_embeddings,
        padded_vocab_size=0, hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout, init_method_std=args.init_method_std,
        layernorm_epsilon=args.layernorm_epsilon, openai_gelu=args.openai_gelu,
        params_dtype=args.params_dtype,
        num_tokentypes=getattr(args, "num_tokentypes", 0) or 0,
        recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers, compile_layers=args.compile_layers,
        cross_entropy_loss_fusion=args.cross_entropy_loss_fusion,
        attention_backend=args.attention_backend, normalization=args.normalization,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base, rotary_percent=args.rotary_percent,
        rope_scaling=args.rope_scaling, rope_scaling_factor=args.rope_scaling_factor,
        rotary_interleaved=args.rotary_interleaved,
        rotary_seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
        init_method_xavier_uniform=args.init_method_xavier_uniform,
        squared_relu=args.squared_relu,
        apply_residual_connection_post_layernorm=args.apply_residual_connection_post_layernorm,
        fp32_residual_connection=args.fp32_residual_connection,
        swiglu=args.swiglu, qk_layernorm=args.qk_layernorm, kv_channels=args.kv_channels,
        num_query_groups=args.query_groups, add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        sequence_parallel=args.sequence_parallel)
    if model.num_tokentypes > 0:
        _check_bert_model(args, model)
    return model


def _check_bert_model(args: argparse.Namespace, model: ModelConfig) -> None:
    """A model with token types is BERT's: refuse the options built for GPT only."""
    from megatron.model.transformer import non_gpt2_options

    llama = non_gpt2_options(model)
    require(not llama, f"{', '.join(llama)}: built for GPT models only; BERT "
                        f"(pretraining and finetuning) keeps BERT's block")
    boundaries = [flag_of(d) for d in ("eod_mask_loss", "reset_position_ids",
                                       "reset_attention_mask") if getattr(args, d)]
    require(not boundaries, f"{', '.join(boundaries)}: GPT only (BERT's samples are "
                             f"sentence pairs with their own padding mask)")


def parallel_config(args: argparse.Namespace) -> ParallelConfig:
    """The parallel layout, the pipeline schedule and its 2BW mitigation."""
    return ParallelConfig(
        world_size=args.world_size, tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        pipeline_schedule=args.pipeline_schedule,
        decoder_first_pipeline_num_layers=args.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=args.decoder_last_pipeline_num_layers,
        tbw_mitigation=args.tbw_mitigation,
        tbw_flush_warmup_iters=args.tbw_flush_warmup_iters, tbw_dc_lambda=args.tbw_dc_lambda,
        distributed_backend=args.distributed_backend,
        distributed_timeout_minutes=args.distributed_timeout_minutes)


def precision_config(args: argparse.Namespace) -> PrecisionConfig:
    """Mixed precision and loss scaling (fp32 master weights with --fp16 or --bf16)."""
    return PrecisionConfig(
        fp16=args.fp16, bf16=args.bf16, fp64=args.fp64, loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale, min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis,
        fp32_master_weights=args.fp16 or args.bf16,
        accumulate_allreduce_grads_in_fp32=args.accumulate_allreduce_grads_in_fp32)


def optimizer_config(args: argparse.Namespace) -> OptimizerConfig:
    """The optimizer, its learning-rate and weight-decay schedules and the gradient
    buckets; the WSD anneal's length only with --lr-decay-style WSD."""
    return OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr,
        lr_decay_style=args.lr_decay_style, lr_decay_iters=args.lr_decay_iters,
        lr_warmup_iters=args.lr_warmup_iters, lr_schedule_unit=args.lr_schedule_unit,
        lr_decay_samples=args.lr_decay_samples, lr_warmup_samples=args.lr_warmup_samples,
        decoupled_lr=args.decoupled_lr, decoupled_min_lr=args.decoupled_min_lr,
        lr_warmup_init=args.lr_warmup_init, lr_wsd_decay_style=args.lr_wsd_decay_style,
        lr_wsd_decay_iters=args.lr_wsd_decay_iters if args.lr_decay_style == "WSD" else None,
        lr_wsd_decay_samples=(args.lr_wsd_decay_samples if args.lr_decay_style == "WSD"
                              else None),
        weight_decay=args.weight_decay,
        start_weight_decay=args.start_weight_decay, end_weight_decay=args.end_weight_decay,
        weight_decay_incr_style=args.weight_decay_incr_style,
        wd_incr_samples=args.train_samples if args.lr_schedule_unit == "samples" else None,
        clip_grad=args.clip_grad, adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps, sgd_momentum=args.sgd_momentum,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_param_gather=args.overlap_param_gather, ddp_bucket_size=args.ddp_bucket_size)


def data_config(args: argparse.Namespace) -> DataConfig:
    """Datasets, their split and the tokenizer."""
    return DataConfig(
        data_path=list(args.data_path or []), split=args.split,
        train_data_path=list(args.train_data_path or []),
        valid_data_path=list(args.valid_data_path or []),
        test_data_path=list(args.test_data_path or []),
        data_cache_path=args.data_cache_path, num_workers=args.num_workers,
        tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file,
        merge_file=args.merge_file, tokenizer_model=args.tokenizer_model,
        vocab_size=args.vocab_size, make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        eod_mask_loss=args.eod_mask_loss, reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, mock_data=args.mock_data)


def training_config(args: argparse.Namespace) -> TrainingConfig:
    """Batches, length of the run, checkpoints, logging and evaluation, fault handling;
    an entry point's batch schedule when it set one."""
    training = TrainingConfig(
        calculate_per_token_loss=args.calculate_per_token_loss,
        micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
        train_iters=args.train_iters, train_samples=args.train_samples,
        batch_schedule=getattr(args, "batch_schedule", None),
        batch_schedule_source=getattr(args, "batch_schedule_source", ""),
        seed=args.seed, data_parallel_random_init=args.data_parallel_random_init,
        log_interval=args.log_interval, eval_interval=args.eval_interval,
        eval_iters=args.eval_iters, exit_interval=args.exit_interval,
        tensorboard_dir=args.tensorboard_dir, save=args.save, load=args.load,
        save_interval=args.save_interval, no_save_optim=args.no_save_optim,
        no_load_optim=args.no_load_optim, no_load_rng=args.no_load_rng,
        finetune=args.finetune, allow_unsafe_checkpoint=args.allow_unsafe_checkpoint,
        skip_train=args.skip_train, timeline_file=args.timeline_file,
        max_consecutive_skipped_steps=args.max_consecutive_skipped_steps,
        exit_signal_handler=args.exit_signal_handler,
        exit_duration_in_mins=args.exit_duration_in_mins,
        log_num_zeros_in_grad=args.log_num_zeros_in_grad,
        log_params_norm=args.log_params_norm,
        measure_memory_interval=args.measure_memory_interval,
        host_malloc_tuning=args.host_malloc_tuning)
    training.tensorboard = _tensorboard_options(args)
    if getattr(args, "manual_gc", False):
        training.manual_gc = True
        training.manual_gc_interval = args.manual_gc_interval
        training.manual_gc_eval = args.manual_gc_eval
    if getattr(args, "profile", False):  # an entry point's own parser may lack it
        training.profile = ProfileOptions(
            start=args.profile_step_start, end=args.profile_step_end,
            ranks=tuple(args.profile_ranks), pytorch=args.use_pytorch_profiler,
            trace_dir=args.profile_dir or args.tensorboard_dir)
    return training


def _tensorboard_options(args: argparse.Namespace) -> TensorBoardOptions:
    """Megatron-LM's TensorBoard selection flags."""
    return TensorBoardOptions(
        log_interval=args.tensorboard_log_interval, queue_size=args.tensorboard_queue_size,
        timers=args.log_timers_to_tensorboard, batch_size=args.log_batch_size_to_tensorboard,
        learning_rate=args.log_learning_rate_to_tensorboard,
        loss_scale=args.log_loss_scale_to_tensorboard,
        validation_ppl=args.log_validation_ppl_to_tensorboard,
        memory=args.log_memory_to_tensorboard, world_size=args.log_world_size_to_tensorboard)
