"""Similarity Contrastive Estimation (SCE) and its baselines MoCo v2 and ReSSL."""


class UserError(Exception):
    """A mistake the user can fix (path, flag, file): scripts print it as one line, no traceback."""
