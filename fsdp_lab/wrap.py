"""Auto-wrap policies under torch's import path (`torch.distributed.fsdp.wrap` → `fsdp_lab.wrap`)."""
from fsdp_lab.runtime.fsdp1.wrap import (ModuleWrapPolicy, _or_policy, always_wrap_policy, lambda_auto_wrap_policy,
                                         size_based_auto_wrap_policy, transformer_auto_wrap_policy)

__all__ = ["ModuleWrapPolicy", "transformer_auto_wrap_policy", "size_based_auto_wrap_policy",
           "lambda_auto_wrap_policy", "always_wrap_policy", "_or_policy"]
