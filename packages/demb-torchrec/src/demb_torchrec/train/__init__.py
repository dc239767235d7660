"""``demb train``: the main job (:mod:`demb_torchrec.train.loop`), its replica ``demb serve``
(:mod:`demb_torchrec.train.serve`), their settings, data sources, logs and plots. Run it with
``demb train`` or ``python -m demb_torchrec.train``."""

__all__: list[str] = []
