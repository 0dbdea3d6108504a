"""The shim's public API (shim/gpushare.h) as cffi declarations, for ABI mode.

A copy of the header's declarations, since cffi cannot parse the header's
preprocessor lines; tests/shim/test_attach.py compiles these declarations against
the header, so the two cannot drift apart unnoticed.
"""

CDEF = """
enum gpushare_status {
    GPUSHARE_OK = 0,
    GPUSHARE_E_INVAL = -1,
    GPUSHARE_E_ATTACHED = -2,
    GPUSHARE_E_TOO_LATE = -3,
    GPUSHARE_E_LEDGER = -4,
};

enum gpushare_mode {
    GPUSHARE_MODE_INERT = 0,
    GPUSHARE_MODE_ENFORCE = 1,
    GPUSHARE_MODE_BROKEN = 2,
};

enum gpushare_iteration_flags {
    GPUSHARE_RELEASE = 1,
    GPUSHARE_YIELD = 2,
};

struct gpushare_memory {
    unsigned long long used;
    unsigned long long persistent;
    unsigned long long temporary;
    unsigned long long temporary_peak;
    unsigned long long iterations;
};

int gpushare_attach(const char *ledger_path, const char *task_id);
int gpushare_mode(void);
int gpushare_iteration(void);
void gpushare_released(void);
int gpushare_mark_persistent(unsigned long long dptr);
int gpushare_memory(struct gpushare_memory *out);
"""
