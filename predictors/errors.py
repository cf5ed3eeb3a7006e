"""The predictors' one error type: bad input or a bad file, explained in one line."""


class PredictorError(ValueError):
    """Callers outside predictors/ turn it into their own one-line error."""
