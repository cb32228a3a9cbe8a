"""Adam/SGD with fp16 loss scaling, fp32 master weights, global gradient clipping and a
learning-rate schedule, shaped for PipeDream-2BW's two weight buffers."""
from megatron.optimizer.builder import get_megatron_optimizer
from megatron.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron.optimizer.lr_scheduler import OptimizerParamScheduler
from megatron.optimizer.optimizer import MegatronOptimizer, StepInfo

__all__ = ["ConstantGradScaler", "DynamicGradScaler", "MegatronOptimizer",
           "OptimizerParamScheduler", "StepInfo", "get_megatron_optimizer"]
