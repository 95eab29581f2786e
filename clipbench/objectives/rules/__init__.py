"""The built-in clip rules. Each is a short function that reads as its formula (docs/objectives.md).

A rule receives the inputs it names (``r`` the token ratio, ``A`` the advantages, ``s`` GSPO's
sequence ratio, ``logp``, ``mask``, ``u`` uniforms, ...: the fields of ``inputs.RuleInputs``) and its parameters
as keyword arguments, and returns the per-token loss l (B, T) (or a per-sequence loss (B, 1),
broadcast to the sequence's tokens). The loss is minimised. Nothing else: padding, the KL term,
aggregation and every diagnostic (quadrant cells, zero-gradient, rescued, near-band tokens) are
derived by ``policy_loss`` from what the rule returns, the same way for every rule, built-in or plugin.

Conventions: ``sg(x)`` is ``x.detach()``; bands are closed (a ratio exactly on a bound is inside, as
in torch.clamp's gradient); ``d`` is how far a ratio lies past the PPO clip's active bound
(:func:`past_bound`).

One module per family (``FAMILIES``, in the order docs/objectives.md shows them; each module's
docstring opens with the family's title): clip (hard clips), sequence (sequence-level ratios),
rescue (NSR, decay), soft (gradient kept past the bound, ASPO), divergence (trust regions that are
not a ratio clip, plain and tapered policy gradient, quadratic penalties), masks (tokens or
sequences dropped by how far the policy moved: OPSM, GLM-5's rollout IS, IPO), batch (bounds from a
statistic of the whole mini-batch: BAPO, M2PO). Importing this package registers every built-in
rule; the formulas they share are in objectives/primitives.py. A rule's docstring is its
reference: the first line its formula and summary, the rest its gradient and notes
(docs/objectives.md's tables are written from them: ``python -m clipbench.objectives.reference``).
"""

from clipbench.objectives.rules import batch, clip, divergence, masks, rescue, sequence, soft  # importing registers

FAMILIES = (clip, sequence, rescue, soft, divergence, masks, batch)
