"""Model card and Hub upload for finished kq checkpoints (`kq card`, `kq publish`)."""

from kq.publish.card import card_status, render_card, write_card
from kq.publish.plan import PublishPlan, plan_publish
from kq.publish.publish import PublishResult, publish, verify_or_refuse

__all__ = ["PublishPlan", "PublishResult", "card_status", "plan_publish", "publish", "render_card",
           "verify_or_refuse", "write_card"]
