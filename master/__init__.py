"""The kfp-elastic job master: creates workers through a launcher and keeps the job between its
minimum and maximum size. ``master.launcher`` is the launcher interface, ``master.pod_spec``
builds worker pod manifests without any I/O, ``master.k8s_launcher`` runs them on Kubernetes."""
