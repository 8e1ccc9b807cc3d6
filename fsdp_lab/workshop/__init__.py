"""A class on one lab server: the pieces `fsdp-lab workshop` puts together around JupyterHub.

    install      the pinned JupyterHub, idle culler and configurable-http-proxy, installed where the course's
                 environment is (pip) and in a project-local npm prefix
    accounts     the class list: learners and instructors as real Unix users
    shares       which GPUs each learner's server sees (CUDA_VISIBLE_DEVICES per slot)
    hub_config   the hub's configuration, applied from one settings file
    learner      what each learner's server runs first: their own copy of the chapters, then the single-user server
    class_state  what the instructor sees of each learner, read from their files and processes
    class_view   the instructor's page: a hub service, admins only

This layer sits between lessons (whose files it reads) and commands (which starts it).
"""
