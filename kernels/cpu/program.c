/* A prepared sequence of kernel calls run by one call: a decode step's whole forward
 * (engine/cpu_decode.py records it) without a trip through Python between kernels.
 *
 * Each op is two 8-byte fields, an entry point's address and its argument struct's,
 * packed once by the Python bindings exactly as their own calls pack them; the structs
 * point at fixed buffers, so a step only refills the inputs and runs the list again. The
 * first op to fail stops the run: its index comes back, its own struct names the bad
 * input (as when Python called it).
 */
#include "common.h"

typedef int (*pd_entry)(int64_t *args);

typedef struct {
    int64_t ops, num_ops;
    int64_t bad;
} pd_program_call;

int64_t pd_program_call_size(void) { return sizeof(pd_program_call); }

int pd_run_program(pd_program_call *c) {
    const int64_t *ops = (const int64_t *)PTR(c->ops);
    for (int64_t i = 0; i < c->num_ops; i++) {
        int rc = ((pd_entry)PTR(ops[2 * i]))((int64_t *)PTR(ops[2 * i + 1]));
        if (rc) return fail_at(&c->bad, i, rc);
    }
    return PD_OK;
}
