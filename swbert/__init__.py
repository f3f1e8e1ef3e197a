"""swbert: BERT-style encoders whose self-attention shares one weight matrix for Q, K and V."""

import swbert._startup  # noqa: F401  (first: keeps imports a job does not use out of every rank)
from swbert.models import (
    ATTENTION_TYPES,
    SIZES,
    SWBertConfig,
    SWBertForMaskedLM,
    SWBertForQuestionAnswering,
    SWBertForSequenceClassification,
    SWBertModel,
)

__version__ = "0.1.0"

__all__ = [
    "ATTENTION_TYPES",
    "SIZES",
    "SWBertConfig",
    "SWBertForMaskedLM",
    "SWBertForQuestionAnswering",
    "SWBertForSequenceClassification",
    "SWBertModel",
    "__version__",
]
