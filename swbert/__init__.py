"""swbert: BERT-style encoders whose self-attention shares one weight matrix for Q, K and V."""

import swbert._startup  # noqa: F401  (first: keeps imports a job does not use out of every rank)

# The public names, re-exported explicitly (`X as X`); swbert.models lists the rest of the model API.
from swbert.models import (
    ATTENTION_TYPES as ATTENTION_TYPES,
    SIZES as SIZES,
    SWBertConfig as SWBertConfig,
    SWBertForMaskedLM as SWBertForMaskedLM,
    SWBertForQuestionAnswering as SWBertForQuestionAnswering,
    SWBertForSequenceClassification as SWBertForSequenceClassification,
    SWBertModel as SWBertModel,
)

__version__ = "0.1.0"
