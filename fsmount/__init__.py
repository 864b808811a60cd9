"""modelfs: a FUSE filesystem over S3 / Alibaba OSS, tuned for loading model weights (read-only unless
--writable, for checkpoints).

The package is `fsmount`; the console script is `modelfs` (see `fsmount.cli`).
"""

__version__ = "0.1.0"
