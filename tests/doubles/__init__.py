"""Recording doubles of the vendor modules (torch_npu, aiter, IPEX and torch.xpu, torch_musa).

A double stands in for a vendor module on a CPU-only machine. Each op:

1. records the call (``recording.Call``: function name, and per argument name
   what the real op would see: shape, dtype, device, strides of tensors; type
   and value of host values);
2. checks it against the vendor's call contract as ../shared/platform_apis.md
   states it (layouts, argument names, dtypes, mask polarity, the
   cumulative-length convention) and raises ``ContractViolation`` where the
   real op would reject or misread the call;
3. computes the result with the reference (``omni.reference``,
   ``omni.quant``), interpreting the arguments by the vendor's convention,
   so a convention error also shows up as a wrong result.

``install_*`` functions put a double into ``sys.modules`` and fake the device
state a platform's detection reads (``torch.version.hip``, ``torch.npu``,
``torch.xpu``, ``torch.musa``), all through a pytest ``monkeypatch``, so
everything is undone after the test. Only CPU tensors flow through them.
"""
