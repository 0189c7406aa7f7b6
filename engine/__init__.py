"""The inference engine, one layer below the app: its shared types (config, events), and the rooms model/
(the transformer and its loading), spec/ (speculation: tree, verification, drafters, loops), host/ (the
Engine in the app's process) and worker/ (the torchrun workers), imported in that order, never upward."""
