"""kvclient's error types: the kvstore exception tree (see ``kvstore.errors``)."""

from kvstore.errors import *  # noqa: F403
from kvstore.errors import __all__ as __all__
