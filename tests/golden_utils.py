"""Helpers over the golden data fixture (see conftest.py)."""
from __future__ import annotations

import torch


def build_golden_model(golden_data, platform, **opts):
    """The tiny golden transformer with its official weights on ``platform`` (fp32; ``opts``: other BuildOptions)."""
    from omni.build_options import BuildOptions
    from omni.models.hunyuan_image3.config import HunyuanImage3Config
    from omni.models.hunyuan_image3.transformer import HunyuanImage3Transformer, load_state

    m = HunyuanImage3Transformer(HunyuanImage3Config.from_json_dict(golden_data[0]["tiny_config"]),
                                 platform, BuildOptions(dtype=torch.float32, **opts))
    load_state(m, golden_data[2])
    m.finalize()
    return m.eval()
