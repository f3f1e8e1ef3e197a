"""From start/end logits over windows back to answer strings (n-best span decoding).

For every question, each of its windows proposes spans from its ``n_best`` highest start and end
logits; a span must lie inside the context, end at or after its start, and be at most
``max_answer_length`` tokens. The best span over all windows wins. For SQuAD v2.0 the "no answer"
score is the smallest ``[CLS]`` start+end logit over the windows (as the BERT reference does), and the
question is left unanswered when that beats the best span by more than ``null_threshold``.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

import numpy as np

from swbert.finetune.squad_data import SquadEvalFeatures, SquadExample


@dataclass
class SquadPredictions:  # by question id
    answers: dict[str, str]  # the final answer ("": no answer)
    best_spans: dict[str, str]  # the best non-null span, whatever the threshold (for its search)
    null_score_diffs: dict[str, float]  # null score minus best span score (higher: prefers no answer)


def decode_spans(
    examples: list[SquadExample],
    features: SquadEvalFeatures,
    start_logits: np.ndarray,
    end_logits: np.ndarray,
    version: str = "1.1",
    n_best: int = 20,
    max_answer_length: int = 30,
    null_threshold: float = 0.0,
) -> SquadPredictions:
    """Turn per-window logits ``(windows, seq_len)`` into answers for every example."""
    if len(start_logits) != len(features.example_index):
        raise ValueError(f"{len(start_logits)} rows of logits for {len(features.example_index)} windows")
    by_example: dict[int, list[int]] = collections.defaultdict(list)
    for w, ex_i in enumerate(features.example_index):
        by_example[ex_i].append(w)
    answers, best_spans, diffs = {}, {}, {}
    for ex_i, ex in enumerate(examples):
        best_score, best_text, null_score = -math.inf, "", math.inf
        for w in by_example[ex_i]:
            s_log, e_log, offsets = start_logits[w], end_logits[w], features.offsets[w]
            cls = features.cls_index[w]
            null_score = min(null_score, float(s_log[cls] + e_log[cls]))
            ends = np.argsort(e_log)[::-1][:n_best]
            for s in np.argsort(s_log)[::-1][:n_best]:
                for e in ends:
                    if offsets[s] is None or offsets[e] is None or not 0 <= e - s < max_answer_length:
                        continue
                    if (score := float(s_log[s] + e_log[e])) > best_score:
                        best_score, best_text = score, ex.context[offsets[s][0] : offsets[e][1]]
        best_spans[ex.qid] = best_text
        diffs[ex.qid] = diff = null_score - best_score if best_score > -math.inf else math.inf
        answers[ex.qid] = "" if version == "2.0" and diff > null_threshold else best_text
    return SquadPredictions(answers, best_spans, diffs)
