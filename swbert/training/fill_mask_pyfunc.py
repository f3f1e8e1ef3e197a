"""An MLflow pyfunc model that fills [MASK] tokens with an exported swbert folder.

MLflow copies this file into the logged model ("models from code"), and it imports no swbert: the
folder's own code, through transformers' `trust_remote_code`, builds the model. So

    mlflow.pyfunc.load_model(f"runs:/{run_id}/model").predict(["the cat [MASK] on the mat"])

works wherever transformers and torch are installed, and returns for each text the top
predictions of transformers' fill-mask pipeline (token, token_str, score, sequence).
"""

from __future__ import annotations

import mlflow
from mlflow.pyfunc import PythonModel


class FillMask(PythonModel):
    def load_context(self, context):
        from transformers import pipeline

        self.fill = pipeline("fill-mask", model=context.artifacts["model"], trust_remote_code=True)

    def predict(self, context, model_input, params=None):
        """`model_input`: a string, a list of strings, or a DataFrame whose first column holds them.

        (No type hints: MLflow would read them as an input schema.)"""
        if hasattr(model_input, "columns"):  # pandas DataFrame
            model_input = model_input[model_input.columns[0]].tolist()
        texts = [model_input] if isinstance(model_input, str) else list(model_input)
        top_k = int((params or {}).get("top_k", 5))
        return [self.fill(text, top_k=top_k) for text in texts]


mlflow.models.set_model(FillMask())
