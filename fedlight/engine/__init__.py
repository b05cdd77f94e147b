"""The engine that runs the rounds: :class:`FederatedTrainer` and the pieces it delegates to.

=====================  ==========================================================================
``trainer``            ``FederatedTrainer``: the signature, the entry points and the round loop
``setup``              the settings, checks and set-up of a run: its inputs, pieces and progress
``run``                the run as one typed object: settings, inputs, pieces, progress
``config``             the trainer's settings, grouped by the piece that reads them
``model``              the resident client module and the global model W^t (its bank)
``fits``               a round's local fits on this process, streamed into the round's sums
``local_fit``          one client's fit on the resident module; the local training loop
``whole_step``         a client's forward, loss, backward and update compiled as one graph
``batched``            clients trained together as one vectorised model
``stacked``            the stacked clients' optimizer state, and their update inside the compiled step
``aggregation``        W^{t+1} from the streamed sums or the gathered states
``evaluation``         the global model on the held-out splits and the test set
``guards``             failed, non-finite and outsized clients; a diverged global model
``run_state``          where a run stands; what a checkpoint holds, and whether it belongs to the run
``streams``            the random streams derived from the seed
``hooks``              round callbacks as the loop calls them
``launch``             processes: starting or forking them, assigning clients, threads
``rundir``             the run folder, its lock and leftovers
``console``, ``loggers``  what a run prints; metrics.csv and W&B
``stopping``           SIGINT/SIGTERM: stop with a checkpoint, or drop the round in progress
=====================  ==========================================================================

Rules, clients and callbacks never import from here: what they see of a run is :mod:`fedlight.context`.
"""

from fedlight.engine.trainer import FederatedTrainer

__all__ = ["FederatedTrainer"]
