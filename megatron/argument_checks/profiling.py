"""--profile and its window, --manual-gc: Megatron-LM's flags, checked before any rank
waits."""
from __future__ import annotations

import argparse

from megatron.argument_checks.checkpoint import check_writable_dir
from megatron.argument_checks.errors import require

_WINDOW_FLAGS = ("--use-pytorch-profiler", "--profile-step-start", "--profile-step-end",
                 "--profile-ranks", "--profile-dir")


def check_manual_gc(args: argparse.Namespace) -> None:
    if not hasattr(args, "manual_gc"):  # an entry point's own parser may lack the flags
        return
    given = getattr(args, "flags_given", ())
    if not args.manual_gc:
        for flag in ("--manual-gc-interval", "--no-manual-gc-eval"):
            require(flag not in given, f"{flag} needs --manual-gc (without it Python's "
                                       "collector runs on its own)")
    require(args.manual_gc_interval >= 0,
            f"--manual-gc-interval must be >= 0 (0: no collection between evaluations), "
            f"got {args.manual_gc_interval}")


def check_profile(args: argparse.Namespace, world_size: int) -> None:
    """A profiler window that would record nothing, or could not be written, is one
    error line naming the flag.  Without --profile the window flags do nothing, so a
    window given without it is refused rather than ignored."""
    if not hasattr(args, "profile"):  # an entry point's own parser may lack the flags
        return
    if not args.profile:
        given = [f for f in _WINDOW_FLAGS if f in getattr(args, "flags_given", ())]
        require(not given, f"{given[0] if given else ''} needs --profile (without it "
                           "nothing is profiled)")
        return
    require(not args.skip_train, "--profile profiles training batches, and --skip-train "
                                 "trains none: drop one of them")
    start, end = args.profile_step_start, args.profile_step_end
    require(start >= 0, f"--profile-step-start must be >= 0 (a 0-based iteration), got {start}")
    require(end > start, f"--profile-step-end ({end}) must be greater than "
                         f"--profile-step-start ({start}): batches start <= t < end are "
                         "profiled")
    bad = [r for r in args.profile_ranks if not 0 <= r < world_size]
    require(not bad, f"--profile-ranks: rank {bad[0] if bad else ''} is not a rank of this "
                     f"run (global ranks 0..{world_size - 1})")
    if args.use_pytorch_profiler:
        require(args.profile_dir is not None or args.tensorboard_dir is not None,
                "--use-pytorch-profiler writes each profiled rank's trace under "
                "--profile-dir, else --tensorboard-dir (Megatron-LM's place): give one")
        if args.profile_dir is not None:
            check_writable_dir("--profile-dir", args.profile_dir)
    else:
        require(args.profile_dir is None, "--profile-dir is where --use-pytorch-profiler "
                                          "writes its traces: add --use-pytorch-profiler")
        from megatron.initialize import resolve_backend

        require(resolve_backend(args.distributed_backend, None) == "nccl",
                "--profile without --use-pytorch-profiler marks the window for nsys "
                "(cudaProfilerStart/Stop), which needs ranks on CUDA devices; add "
                "--use-pytorch-profiler to profile these CPU ranks with torch.profiler")
    if args.train_iters is not None:
        require(start < args.train_iters,
                f"--profile-step-start {start} is past the run's last iteration "
                f"(--train-iters {args.train_iters}): nothing would be profiled")
