"""Hardware specs, cost model and learned throughput predictors. Never imports `onboard`."""
