"""A run before it starts: what it is asked to do, checked and planned before any process group
starts: the command line (cli), which options work with which engine (compat), the DeepSpeed JSON
and its schema (ds_config, ds_schema), the plan (plan), the run's folders (rundir) and its records
(records). The settings' types are vit.core's."""
