"""Auto-wrap policies under torch's import path (`torch.distributed.fsdp.wrap` → `fsdp_lab.wrap`)."""
from fsdp_lab.runtime.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy, transformer_auto_wrap_policy

__all__ = ["ModuleWrapPolicy", "transformer_auto_wrap_policy", "size_based_auto_wrap_policy"]
