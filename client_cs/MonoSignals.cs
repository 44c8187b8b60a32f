using System;
using System.Reflection;
using System.Threading;

namespace ChatCli
{
    /// <summary>
    /// SIGINT for Mono without a terminal. Mono runs Console.CancelKeyPress only when stdin and stdout
    /// are both terminals; otherwise SIGINT ends the process at once (client_cs/README.md). Mono's own
    /// Mono.Posix assembly (installed with mono-devel) has UnixSignal, which catches it anyway. It is
    /// reached by reflection, so the same source builds with the .NET SDK, where this does nothing
    /// (.NET runs CancelKeyPress in every case).
    /// </summary>
    public static class MonoSignals
    {
        const string Assembly = ", Mono.Posix, Version=4.0.0.0, Culture=neutral, PublicKeyToken=0738eb9f132ed756";
        static int installed;

        /// <summary>From now on, runs <paramref name="handler"/> on a thread of its own at every SIGINT
        /// (once per process; later calls do nothing). False when not on Mono or Mono.Posix is missing.</summary>
        public static bool OnSigint(Action handler)
        {
            if (Type.GetType("Mono.Runtime") == null) return false;
            if (Interlocked.Exchange(ref installed, 1) == 1) return true;
            try
            {
                Type signalType = Type.GetType("Mono.Unix.UnixSignal" + Assembly, false);
                Type signum = Type.GetType("Mono.Unix.Native.Signum" + Assembly, false);
                if (signalType == null || signum == null) return false;
                var signal = (WaitHandle)Activator.CreateInstance(signalType, Enum.Parse(signum, "SIGINT"));
                MethodInfo reset = signalType.GetMethod("Reset", Type.EmptyTypes);
                var thread = new Thread(() =>
                {
                    while (signal.WaitOne())
                    {
                        if (reset != null) reset.Invoke(signal, null);
                        handler();
                    }
                });
                thread.IsBackground = true;
                thread.Name = "SIGINT";
                thread.Start();
                return true;
            }
            catch (Exception e) when (e is TargetInvocationException || e is MissingMethodException ||
                                      e is TypeLoadException || e is System.IO.FileNotFoundException ||
                                      e is ArgumentException || e is NotSupportedException)
            {
                GC.KeepAlive(e);
                return false;
            }
        }
    }
}
