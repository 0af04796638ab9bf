"""step_profile with DartEngine.hold_steps raised to 1000 (the held positions' catch-up deferred past a
64-token run): the check of bench/results/gated_off_step_a8/README.md, not part of the engine."""
import sys
from dart_core.step import engine as E
orig = E.DartEngine.__init__
def init(self, *a, **k):
    orig(self, *a, **k); self.hold_steps = 1000
E.DartEngine.__init__ = init
from dart_core.bench import step_profile
sys.exit(step_profile.main(sys.argv[1:]) or 0)
