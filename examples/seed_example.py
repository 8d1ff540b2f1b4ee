import asyncio
from jukebox import Jukebox, SandboxPolicy, CircuitBreaker

jb = Jukebox(
    tape_dir="./tapes",
    sandbox=SandboxPolicy(filesystem="copy_on_write", mcp_mode="staged_acid"),
    breaker=CircuitBreaker(max_cost_usd=0.50, max_semantic_repeat=3),
)

@jb.track(name="invoice-reconciliation-agent")
async def run_accounting_agent(customer_id: str, amount_usd: float) -> dict:
    async with jb.transaction(tape_id="tr_8f92a1c4") as tx:
        tx.record_agent_turn(
            agent_name="planner",
            message=f"Staging refund of ${amount_usd} for {customer_id}",
            model="gpt-4o",
            cost_usd=0.008,
        )
        tx.stage_file_write(
            path="./tapes/staged_ledger_demo.json",
            content=f'{{"customer": "{customer_id}", "refund_usd": {amount_usd}}}',
        )

        if amount_usd > 500.0:
            await tx.rollback(reason="Refund exceeds $500 autonomous threshold")
            return {"status": "ROLLED_BACK", "tape_id": tx.tape_id}

        await tx.commit()
        return {"status": "COMMITTED", "tape_id": tx.tape_id}

if __name__ == "__main__":
    print(asyncio.run(run_accounting_agent("cust_9981", 420.00)))
