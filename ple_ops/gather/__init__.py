"""The gather transport: lookup tables in page-locked host memory, read zero-copy by one kernel in the graph.

* ``host_rows``      -- ``pin_rows``: a table copied into page-locked memory as gatherable rows.
* ``host_table``     -- ``gather_from_host``: every PLE layer of a model served that way.
* ``host_embedding`` -- ``host_embedding``: the same for a stock ``nn.Embedding`` (or Gemma 3n's
                        scaled one) in a transformers model, in one call.
"""

from .host_embedding import HostEmbedding, host_embedding
from .host_table import gather_from_host

__all__ = ["HostEmbedding", "host_embedding", "gather_from_host"]
