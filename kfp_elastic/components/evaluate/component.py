"""KFP component: evaluate a trained model on a split of its model definition's dataset."""

from kfp import dsl
from kfp.dsl import ClassificationMetrics, Input, Metrics, Model, Output

from kfp_elastic.components import BASE_IMAGE


@dsl.component(base_image=BASE_IMAGE, install_kfp_package=False)
def evaluate(
    model: Input[Model],
    metrics: Output[Metrics],
    classification: Output[ClassificationMetrics],
    model_def: str = "",
    split: str = "test",
) -> float:
    """Load ``model`` into ``model_def.model()`` and evaluate it on ``dataset(split)``.

    Args:
        model: weights written by ``elastic_train`` (a ``state_dict``).
        metrics: accuracy, loss and samples (the KFP UI's scalar metrics table).
        classification: the confusion matrix (square, one row and column per class).
        model_def: the model definition module; empty: the one recorded in the model's
            metadata by ``elastic_train``.
        split: the dataset split to evaluate on.

    Returns:
        The accuracy (use it in a ``dsl.If`` to gate a deployment step).
    """
    from kfp_elastic.worker.evaluate import evaluate as run_evaluation

    name = model_def or model.metadata.get("model_def", "")
    if not name:
        raise ValueError("evaluate: model_def is empty and the model's metadata names none")
    result = run_evaluation(name, model.path, split)
    metrics.log_metric("accuracy", round(result.accuracy, 6))
    metrics.log_metric("loss", round(result.loss, 6))
    metrics.log_metric("samples", result.samples)
    if result.labels:
        classification.log_confusion_matrix(result.labels, result.confusion)
    print(
        f"evaluate: {name} on {split}: accuracy={result.accuracy:.4f} loss={result.loss:.4f} "
        f"samples={result.samples}",
        flush=True,
    )
    return float(result.accuracy)
