"""mtpspec: tensor-parallel speculative decoding with MTP draft layers."""

__version__ = "0.1.0"
