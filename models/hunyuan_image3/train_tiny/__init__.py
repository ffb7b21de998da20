"""Training of the embedded default: a tiny HunyuanImage-3.0 that draws coloured shapes.

``data`` renders the synthetic data set (and names the held-out prompts the
quality test uses), ``measure`` reads back what an image shows, ``train``
trains the VAE then the transformer and writes the checkpoint. ``edits`` and
``instruct`` do the same for the tiny Instruct model: edit pairs, trained from
the base checkpoint (``--model instruct``).

    python -m omni.models.hunyuan_image3.train_tiny --help
"""
