"""bitsandbytes for bit-exactness checks, imported without touching the network (the package's importer), or
None where it is not installed or does not import here."""

from __future__ import annotations

from liger_models.train.bnb_optim import import_bitsandbytes


def import_bnb():
    try:
        bitsandbytes = import_bitsandbytes()
        import bitsandbytes.functional  # noqa: F401
    except Exception:  # not installed, or a build that fails to load on this machine: the comparisons skip
        return None
    return bitsandbytes
