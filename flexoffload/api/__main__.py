from flexoffload.api.child import main

main()
