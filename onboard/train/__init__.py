"""Stage: training a bundle's model. `onboard train` (launch: the bundle, plan and job checked, then one process or
torchrun), the model every rank builds (model, record), text data tokenised into packed corpora (data), and
`onboard export` (export). May import every earlier stage (source, twin, inspect, adapt, bundle) and runtime;
nothing below it imports it.

`onboard.train:build_model` is the model factory committed bundles' train.sh names, so it is kept here."""


def __getattr__(name):
    if name == "build_model":  # imported on use: `import onboard.train.request` (the CLI's parser) stays light
        from onboard.train.model import build_model

        return build_model
    raise AttributeError(name)
